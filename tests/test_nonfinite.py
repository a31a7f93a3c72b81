"""inf and NaN gradients: by default a bfloat16 or float32 model stops with an error before any weight takes such
a value; with `nonfinite="skip"` (the float16 default) the step is skipped on every rank and training goes
on. On 2 gloo ranks the NaN comes from one rank only. Tolerance: bitwise (CPU, fp32, the same kernels)."""

import functools

import models
import pytest
import torch
import torch.distributed as dist
from helpers import OFFLOADED
from spawn import spawn_gloo

import protrain_fx

PLANS = {"persistent": {}, "offloaded": OFFLOADED}
NAN_STEP = 2  # after the first step, so offloaded updates start during the backward (they are deferred at first)


def _train(plan, steps, *, nan_at=None, nan_rank=0, nonfinite=None, skip=()):
    """Train the toy model on batches 0..steps-1 (leaving out those in `skip`); the loss of step `nan_at` is
    multiplied by NaN on rank `nan_rank`. Returns (model, optimizer, full weights before each step, error). (Its
    own loop: a step's loss made NaN, and the step that raises, are what is tested.)"""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = models.build("toy")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, nonfinite=nonfinite)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan}))
    before = []
    for step in (s for s in range(steps) if s not in skip):
        before.append(protrain_fx.full_state_dict(model))
        loss = compiled(**models.batch("toy", seed=step))
        if step == nan_at and rank == nan_rank:
            loss = loss * float("nan")
        loss.backward()
        try:
            opt.step()
        except FloatingPointError as e:
            return model, opt, before, e
        opt.zero_grad()
    return model, opt, before, None


def _unchanged(model, opt, before):
    after = protrain_fx.full_state_dict(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    states = opt.state_dict()["state"].values()
    assert all(torch.isfinite(st[k]).all() for st in states for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("plan", PLANS, ids=list(PLANS))
def test_nan_stops_training_before_the_weights_change(plan):
    model, opt, before, error = _train(PLANS[plan], NAN_STEP + 2, nan_at=NAN_STEP)
    assert error is not None and "inf or NaN" in str(error) and "nonfinite='skip'" in str(error)
    assert len(before) == NAN_STEP + 1
    _unchanged(model, opt, before[-1])
    assert {int(st["step"]) for st in opt.state_dict()["state"].values()} == {NAN_STEP}


def _raise_rank(rank, world):
    for name, plan in PLANS.items():  # each plan in turn on the same ranks (starting them costs more than a plan)
        torch._dynamo.reset()
        model, opt, before, error = _train(plan, NAN_STEP + 2, nan_at=NAN_STEP, nan_rank=1)
        assert error is not None, f"rank {rank} went on training ({name})"
        _unchanged(model, opt, before[-1])


def _skip_rank(plan, rank, world):
    model, opt, _, _ = _train(plan, NAN_STEP + 2, nan_at=NAN_STEP, nan_rank=1, nonfinite="skip")
    reference, _, _, _ = _train(plan, NAN_STEP + 2, skip=(NAN_STEP,))  # the same batches, without the NaN one
    got, expected = protrain_fx.full_state_dict(model), protrain_fx.full_state_dict(reference)
    assert all(torch.equal(got[k], v) for k, v in expected.items()), rank


def test_nan_on_one_rank_stops_every_rank():
    """Every plan of PLANS, one after the other on the same 2 ranks."""
    spawn_gloo(_raise_rank, 2)


def test_nan_on_one_rank_skips_the_step_on_every_rank():
    """nonfinite="skip": the step with a NaN on rank 1 is skipped on both ranks, and training goes on as if
    that batch had not been there."""
    spawn_gloo(functools.partial(_skip_rank, PLANS["offloaded"]), 2)


def test_nonfinite_policy_is_checked():
    with pytest.raises(ValueError, match="nonfinite='ignore'"):
        protrain_fx.optim.AdamW(models.build("toy").parameters(), nonfinite="ignore")
