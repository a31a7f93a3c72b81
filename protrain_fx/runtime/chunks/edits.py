"""Edits: gradients and hyperparameters looked at or changed outside the compiled graphs, between backward() and
optimizer.step() (clipping, loss scaling, gradient logging, an lr set there), which updates that start during the
backward would miss.

From the first step that does so, updates wait for `AdamW.step()` (`after_backward`), but the last `n_clip_overlap`
offloaded chunks, which update during the backward while the last step changed nothing (`speculates`,
runtime/chunks/updates.py), keeping what the update changes to undo it. An update that started with what was changed
is undone where it kept a copy, and an error otherwise (`check_not_started`).

A part the ChunkManager composes (`manager.edits`). State it owns: `after_backward`; `loss_scaled` (float16: the
overflow check must see every gradient of the step before any update) and `torch_scaled` (stepped by
torch.amp.GradScaler); `n_clip_overlap` (the plan's, set where the plan is applied). It marks the step's state
(`step_state.edited`) and undoes speculative updates through the callable it is given; whether the last step
changed anything is the step's state too (`step_state.last_edited`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from protrain_fx.runtime.chunks.step_state import StepState

log = logging.getLogger(__name__)


class Edits:
    """Changes between backward() and step() (module docstring)."""

    def __init__(self, step_state: StepState, *, loss_scaled: bool, undo_speculative: Callable[[], None]):
        self.step_state = step_state
        self._undo_speculative = undo_speculative
        # float16 needs loss scaling, whose overflow check must see every gradient of the step before any update:
        # offloaded updates then start in AdamW.step() instead of during the backward (`skips_nonfinite`)
        self.loss_scaled = loss_scaled
        self.torch_scaled = False  # stepped by torch.amp.GradScaler (`scale_losses`)
        # gradients or hyperparameters looked at or changed between backward() and optimizer.step() (`note_edit`):
        # from the first step that does so, updates wait for `AdamW.step()` but those that `speculates` allows.
        # The first step always waits
        self.after_backward = False
        self.n_clip_overlap = 0  # the plan's (planner/plan.py): the last chunks that may update before a clip

    def scale_losses(self, what: str) -> None:
        """`what` scales the loss (torch.amp.GradScaler, seen at a step): from now on every update waits for the
        step, which divides the scale out and skips a step with an inf or NaN gradient."""
        if not self.torch_scaled:
            log.info("%s: chunk updates wait for optimizer.step()", what)
            self.torch_scaled = True
        self.check_not_started(sorted(self.step_state.started), f"{what}, first seen at this step,")

    def check_not_started(self, chunks: Sequence[int], what: str) -> None:
        """A change to the chunks' gradients (or hyperparameters) outside the graphs: their update must not have
        started with them during the backward. Updates that kept a copy of what they changed are undone (and run
        again in the step); others cannot be, which is an error."""
        started = sorted(set(chunks) & self.step_state.started)
        if not started:
            return
        self.note_edit(what)
        if set(started) <= self.step_state.speculative:
            self._undo_speculative()
            return
        raise RuntimeError(
            f"{what}: the optimizer update of chunk(s) {started} had started during the backward with things as "
            "they were then (chunks update as soon as their gradient is complete, unless an earlier step changed "
            "gradients or hyperparameters between backward() and optimizer.step()). From the next step on updates "
            "wait for optimizer.step(); this step's cannot be redone, so resume from the last checkpoint. To avoid "
            "it, make such changes in every step, from the first (clip every step, say), or before the forward"
        )

    def note_read(self) -> None:
        """A gradient is read outside the graphs between backward() and optimizer.step() (clipping or logging a
        norm): from now on updates wait for the step, where the gradient may have been changed."""
        if self.step_state.in_window:
            self.expect_edits("gradients read")

    def expect_edits(self, what: str) -> None:
        """Gradients or hyperparameters are looked at, and may be changed, between backward() and step() (not by a
        backward): from now on updates wait for the step (`after_backward`)."""
        if torch._C._current_graph_task_id() != -1:
            return
        if not self.after_backward:
            log.info("%s between backward() and optimizer.step(): chunk updates wait for the step", what)
        self.after_backward = True

    def note_edit(self, what: str) -> None:
        """Gradients or hyperparameters changed between backward() and optimizer.step() (not by a backward)."""
        if torch._C._current_graph_task_id() != -1:
            return
        self.expect_edits(what)
        self.step_state.edited = True

    def edit_grads(self, what: str) -> None:
        """Every gradient of the step is about to change (clipping): updates that started with them are undone
        where they kept a copy, and an error otherwise."""
        self.note_edit(what)
        self.check_not_started(sorted(self.step_state.started), what)
