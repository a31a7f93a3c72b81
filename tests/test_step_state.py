"""StepState on its own (protrain_fx/runtime/chunks/step_state.py): a step's phases and the updates it started; and
on a prepared toy model, the phases a training loop walks through (eager executor, fp32)."""

from __future__ import annotations

import models
import pytest
import torch
from helpers import OFFLOADED

import protrain_fx
from protrain_fx.runtime.chunks import MANAGER_ATTR
from protrain_fx.runtime.chunks.step_state import Phase, StepState


def test_a_step_goes_from_its_first_gradient_to_its_close():
    step = StepState()
    assert step.phase is Phase.BETWEEN and step.first and not step.busy
    step.gradient()
    step.start(0, early=True)
    step.start(2, speculative=True)
    assert step.in_window and step.busy and step.started == {0, 2} and step.early == {0} and step.speculative == {2}
    step.ended({0, 2})
    assert step.started == set() and step.speculative == set() and step.early == {0}  # (published at the step's end)
    step.optimizers_stepped.add(7)
    step.edited = True
    step.close(had_grads=True)
    assert step.phase is Phase.BETWEEN and not step.first and step.optimizers_stepped == set()
    assert step.last_edited and not step.edited
    step.gradient()
    step.close(had_grads=True)
    assert not step.last_edited


def test_a_close_without_gradients_leaves_the_first_step_first():
    step = StepState()
    step.gradient()
    step.close(had_grads=False)  # (zero_grad before the first backward)
    assert step.first and step.phase is Phase.BETWEEN


def test_an_undone_update_runs_again_in_the_step():
    step = StepState()
    step.gradient()
    step.start(3, speculative=True)
    step.undone(3)
    assert step.started == set() and step.speculative == set() and step.in_window


def test_a_lost_step_stays_lost_until_skipped():
    step = StepState()
    step.lose()
    step.gradient()  # (a gradient after the error: ignored with the step)
    assert step.lost and not step.in_window and step.busy
    step.skipped()
    assert step.phase is Phase.BETWEEN and not step.busy


def test_closing_a_step_not_under_way_is_an_invariant_error():
    with pytest.raises(AssertionError, match="BETWEEN"):
        StepState().close(had_grads=True)


def test_a_training_loop_walks_the_phases():
    """backward() opens the step, AdamW.step() and zero_grad() close it; from the second step on the offloaded
    chunks' updates start during the backward."""
    model = models.build("toy", layers=2)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": OFFLOADED}))
    seen = []
    for step in range(3):
        loss = compiled(**models.batch("toy", 2, 16, seed=step))
        state = next(iter(model.parameters())).__dict__[MANAGER_ATTR].step_state
        assert state.phase is Phase.BETWEEN
        loss.backward()
        seen.append((state.phase, state.first, bool(state.started)))
        opt.step()
        opt.zero_grad()
        assert state.phase is Phase.BETWEEN and not state.first and not state.busy
    assert seen == [(Phase.GRADIENTS, True, False), (Phase.GRADIENTS, False, True), (Phase.GRADIENTS, False, True)]
