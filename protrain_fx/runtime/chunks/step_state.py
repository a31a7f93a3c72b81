"""StepState: where one model's training step is, as named phases, and which chunk updates it has started.

A part the ChunkManager composes (`manager.step_state`), holding all of its state:
- `phase`: BETWEEN (no step under way), GRADIENTS (from a step's first gradient, by a backward or a `.grad` the user
  made, until every optimizer holding a chunk with a gradient has stepped), or LOST (a backward ran out of memory
  under on_oom="replan": later gradients are ignored until `AdamW.step()` skips the step);
- `first`: no step has ended with gradients yet (its updates wait for `AdamW.step()`);
- `started`: chunks whose update started this step; of them `early`, persistent chunks updated during the backward
  whose compute-dtype parameters take the new master at the step's end, and `speculative`, offloaded chunks updated
  during the backward with what they changed kept (undone if clipping applies after all);
- `optimizers_stepped`: the optimizers (ids) whose `step()` ran since the step's backward;
- `edited`: gradients or hyperparameters were changed between this step's backward and its `step()` (edits.py);
  `last_edited`, the last step's (True before the first);
- `join_queued`: the running backward's end waits for its persistent updates (autograd's final callback);
- `keeping`: a skipped step whose updates had started is being applied whole.

The phases change through its methods only; the manager's update and edit code also sets its flags and marks the
optimizers that stepped. No other part writes it.
"""

from __future__ import annotations

import dataclasses
import enum


class Phase(enum.Enum):
    BETWEEN = "between steps"
    GRADIENTS = "gradients arriving or waiting for their optimizers' steps"
    LOST = "lost to an out-of-memory error"


@dataclasses.dataclass
class StepState:
    """One model's step (module docstring)."""

    phase: Phase = Phase.BETWEEN
    first: bool = True
    started: set[int] = dataclasses.field(default_factory=set)
    early: set[int] = dataclasses.field(default_factory=set)
    speculative: set[int] = dataclasses.field(default_factory=set)
    optimizers_stepped: set[int] = dataclasses.field(default_factory=set)
    edited: bool = False
    last_edited: bool = True
    join_queued: bool = False
    keeping: bool = False

    @property
    def in_window(self) -> bool:
        """Between a step's first gradient and the end of its optimizers' steps."""
        return self.phase is Phase.GRADIENTS

    @property
    def lost(self) -> bool:
        return self.phase is Phase.LOST

    def gradient(self) -> None:
        """A gradient of the step arrived (a backward's, or a `.grad` made by the user); a lost step stays lost."""
        if self.phase is Phase.BETWEEN:
            self.phase = Phase.GRADIENTS

    def start(self, chunk: int, *, early: bool = False, speculative: bool = False) -> None:
        """`chunk`'s update started (`early`: a persistent chunk's, during the backward; `speculative`: an offloaded
        chunk's during the backward, undoable)."""
        self.started.add(chunk)
        if early:
            self.early.add(chunk)
        if speculative:
            self.speculative.add(chunk)

    def undone(self, chunk: int) -> None:
        """A speculative update was put back: the chunk updates again in the step."""
        self.started.discard(chunk)
        self.speculative.discard(chunk)

    def ended(self, chunks: set[int]) -> None:
        """The step of `chunks` is over (their optimizer stepped): their next gradient starts a new step."""
        self.started -= chunks
        self.speculative -= chunks

    def close(self, *, had_grads: bool) -> None:
        """Every optimizer holding a chunk with a gradient has stepped: the step is over, and what it edited becomes
        the last step's (the first step ends only with gradients: a zero_grad before the first backward leaves it
        first)."""
        assert self.phase is Phase.GRADIENTS, f"a step closed in phase {self.phase.name}"
        if had_grads:
            self.first = False
        self.last_edited, self.edited = self.edited, False
        self.phase = Phase.BETWEEN
        self.optimizers_stepped.clear()

    def lose(self) -> None:
        """A backward ran out of memory and its step is given up (its gradients dropped already)."""
        self.phase = Phase.LOST

    def skipped(self) -> None:
        """`AdamW.step()` skipped the lost step: the next gradient starts a new one."""
        if self.phase is Phase.LOST:
            self.phase = Phase.BETWEEN

    @property
    def busy(self) -> bool:
        """A step under way: gradients taken, updates started, or the step lost."""
        return self.phase is not Phase.BETWEEN or bool(self.started)  # (speculative updates are started ones)
