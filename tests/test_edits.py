"""Edits on its own (protrain_fx/runtime/chunks/edits.py): what a change between backward() and step() does to the
step's updates; and on a prepared toy model, a loop that clips every step (eager executor, fp32)."""

from __future__ import annotations

import models
import pytest
import torch
from helpers import OFFLOADED

import protrain_fx
from protrain_fx.runtime.chunks.edits import Edits
from protrain_fx.runtime.chunks.step_state import StepState


def _edits() -> tuple[Edits, StepState, list[str]]:
    step, undone = StepState(), []
    return Edits(step, loss_scaled=False, undo_speculative=lambda: undone.append("undone")), step, undone


def test_a_gradient_read_after_the_backward_makes_updates_wait():
    edits, step, _ = _edits()
    edits.note_read()  # (between steps: nothing to wait for)
    assert not edits.after_backward
    step.gradient()
    edits.note_read()
    assert edits.after_backward and not step.edited  # (read, not changed)
    edits.note_edit("clipped")
    assert step.edited


def test_an_edit_undoes_speculative_updates_and_refuses_the_others():
    edits, step, undone = _edits()
    step.gradient()
    step.start(3, speculative=True)
    edits.edit_grads("clip_grad_norm_")
    assert undone == ["undone"] and edits.after_backward
    step.start(1)  # (an update started with nothing kept to undo it)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_: the optimizer update of chunk\(s\) \[1\]"):
        edits.check_not_started([1, 2], "clip_grad_norm_")
    edits.check_not_started([2], "clip_grad_norm_")  # (not started: nothing to do)


def test_loss_scaling_seen_at_a_step_makes_every_update_wait():
    edits, step, _ = _edits()
    edits.scale_losses("torch.amp.GradScaler")
    assert edits.torch_scaled and not edits.after_backward


def test_a_loop_that_clips_every_step_trains_as_eager():
    """The first step's clip makes the updates of the steps after it wait for the step (or run speculatively and be
    undone), so every step applies the clipped gradients, as on the eager model."""
    ref = models.build("toy")
    model = protrain_fx.prepare(models.build("toy"), plan=OFFLOADED, device="cpu")
    manager = protrain_fx.manager_of(model)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}), dynamic=False)
    opts = torch.optim.AdamW(ref.parameters(), lr=1e-2), protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        for m, opt in ((ref, opts[0]), (compiled, opts[1])):
            models.loss_of("toy", m(**models.batch("toy", seed=step))).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
            opt.step()
            opt.zero_grad()
    assert manager.edits.after_backward
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, msg=name)  # (the norm sums in another order: fp32 rounding)
