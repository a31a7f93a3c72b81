"""Global gradient-norm clipping (`protrain_fx.clip_grad_norm_`) against `torch.nn.utils.clip_grad_norm_` on eager
training, over gradients in persistent and offloaded chunks.

Tolerance: the norm sums the same squares in another grouping (per chunk piece instead of per parameter), so
norms and clipped gradients agree to fp32 rounding (rtol 1e-5), and so do the losses of the steps after.
"""

import copy
import math

import models
import pytest
import torch
from helpers import chunk_grads, manager_of
from test_chunk_distributed import spawn_gloo

import protrain_fx

PLANS = {"persistent": {}, "offloaded": {"n_persist": 1, "n_buffer": 3}}
STEPS = 3


def _pair(plan):
    ref = models.build("toy")
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"executor": "eager", "plan": plan}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    return ref, ref_opt, compiled, opt


def _clipped_steps(ref, ref_opt, compiled, opt, max_norm, norm_type, whole_chunks=True):
    """STEPS steps of each model, clipped between backward and step; per step: (norm, ref norm, loss, ref loss),
    and the first step's clipped gradients of both (with `whole_chunks`: each rank holds whole chunks)."""
    rows, grads = [], None
    for step in range(STEPS):
        batch = models.batch("toy", seed=step)
        ref_loss, loss = ref(**batch), compiled(**batch)
        ref_loss.backward()
        loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        norm = protrain_fx.clip_grad_norm_(compiled, max_norm, norm_type)
        if step == 0 and whole_chunks:
            grads = chunk_grads(compiled), {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        rows.append((norm.item(), ref_norm.item(), loss.item(), ref_loss.item()))
    return rows, grads


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("plan", PLANS.values(), ids=list(PLANS))
@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "no-clip"])
def test_clipping_equals_torch(plan, norm_type, max_norm):
    rows, (grads, ref_grads) = _clipped_steps(*_pair(plan), max_norm, norm_type)
    for norm, ref_norm, loss, ref_loss in rows:
        assert norm == pytest.approx(ref_norm, rel=1e-5) and loss == pytest.approx(ref_loss, rel=1e-5)
    if max_norm < 1:
        assert all(ref_norm > max_norm for _, ref_norm, _, _ in rows)  # it did clip: the update changed
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-8, msg=lambda m, name=name: f"{name}: {m}")


def test_host_updates_overlap_the_backward_unless_clipped():
    """The first step defers the offloaded chunks' host updates to optimizer.step() (a clip_grad_norm_ may come);
    from the second on, a model never clipped starts them during the backward again, a clipped one defers."""
    for clip in (False, True):
        _, _, compiled, opt = _pair(PLANS["offloaded"])
        for step in range(3):
            compiled(**models.batch("toy", seed=step)).backward()
            started = bool(manager_of(compiled).updates_started())
            assert started == (step > 0 and not clip), (clip, step)
            if clip:
                protrain_fx.clip_grad_norm_(compiled, 1.0)
            opt.step()
            opt.zero_grad()
        torch._dynamo.reset()


def test_clip_errors():
    _, _, compiled, opt = _pair(PLANS["offloaded"])
    for step in range(2):  # never clipped: the second step's updates start during the backward
        compiled(**models.batch("toy", seed=step)).backward()
        if step == 0:
            opt.step()
            opt.zero_grad()
    with pytest.raises(RuntimeError, match="call it in every step, from the first"):
        protrain_fx.clip_grad_norm_(compiled, 1.0)
    with pytest.raises(ValueError, match="max_norm >= 0 and norm_type > 0"):
        protrain_fx.clip_grad_norm_(compiled, -1.0)
    with pytest.raises(TypeError, match="takes the model"):
        protrain_fx.clip_grad_norm_([], 1.0)


def _ranks_clip(rank: int, world: int) -> None:
    # every rank trains on the same batches: the averaged gradient is eager training's
    rows, _ = _clipped_steps(*_pair(PLANS["offloaded"]), 0.05, 2.0, whole_chunks=False)
    for norm, ref_norm, loss, ref_loss in rows:
        assert norm == pytest.approx(ref_norm, rel=1e-5) and loss == pytest.approx(ref_loss, rel=1e-5)


def test_clipping_across_ranks():
    """Two gloo ranks, offloaded chunks sharded: each rank's shard norms add up over ranks, persistent chunks
    count once; the norm and the losses equal eager training's."""
    spawn_gloo(_ranks_clip, 2)
