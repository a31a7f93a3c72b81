"""Global gradient-norm clipping (`protrain_fx.clip_grad_norm_`) against `torch.nn.utils.clip_grad_norm_` on eager
training, over gradients in persistent and offloaded chunks.

Tolerance: the norm sums the same squares in another grouping (per chunk piece instead of per parameter), so
norms and clipped gradients agree to fp32 rounding (rtol 1e-5), and so do the losses of the steps after.
"""

import contextlib
import copy
import math

import models
import pytest
import torch
from helpers import PLANS, chunk_grads, train
from spawn import spawn_gloo

import protrain_fx
from protrain_fx.runtime.chunks import updates

STEPS = 3


def _pair(plan, device="cpu", dtype=torch.float32):
    ref = models.build("toy").to(device, dtype)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"executor": "eager", "plan": plan}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    return ref, ref_opt, compiled, opt


def _clipped_steps(ref, ref_opt, compiled, opt, max_norm, norm_type, whole_chunks=True):
    """STEPS steps of each model, clipped between backward and step; per step: (norm, ref norm, loss, ref loss),
    and the first step's clipped gradients of both (with `whole_chunks`: each rank holds whole chunks)."""
    norms, ref_norms, grads, ref_grads = [], [], {}, {}

    def clip(step):
        norms.append(protrain_fx.clip_grad_norm_(compiled, max_norm, norm_type).item())
        if step == 0 and whole_chunks:
            grads.update(chunk_grads(compiled))

    def ref_clip(step):
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type).item())
        if step == 0 and whole_chunks:
            ref_grads.update({n: p.grad.clone() for n, p in ref.named_parameters()})

    ref_losses = train(ref, "toy", STEPS, opt=ref_opt, before_step=ref_clip)
    losses = train(compiled, "toy", STEPS, opt=opt, before_step=clip)
    return list(zip(norms, ref_norms, losses, ref_losses)), ((grads, ref_grads) if whole_chunks else None)


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


@pytest.mark.parametrize("plan", PLANS.values(), ids=list(PLANS))
def test_clipping_bfloat16_masters_equals_torch_over_the_bfloat16_model(plan):
    """bfloat16 masters (the plan's master_dtype) clip bfloat16 gradients. torch rounds each parameter's norm and
    the total to bfloat16, we the parameters' norms only (their total and the coefficient in float64): norms,
    clipped gradients and losses agree to bfloat16's rounding."""
    rows, (grads, ref_grads) = _clipped_steps(
        *_pair({**plan, "master_dtype": "bfloat16"}, dtype=torch.bfloat16), 0.05, 2.0
    )
    for norm, ref_norm, loss, ref_loss in rows:
        assert (
            ref_norm > 0.05 and norm == pytest.approx(ref_norm, rel=1e-2) and loss == pytest.approx(ref_loss, rel=1e-2)
        )
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_host_updates_overlap_the_backward_unless_clipped():
    """The first step defers the offloaded chunks' host updates to optimizer.step() (a clip_grad_norm_ may come);
    from the second on, a model never clipped starts them during the backward again, one whose last clip
    scaled its gradients defers."""
    for clip in (False, True):
        _, _, compiled, opt = _pair(PLANS["offloaded"])

        def check(step, clip=clip, compiled=compiled):
            started = bool(protrain_fx.manager_of(compiled).updates_started())
            assert started == (step > 0 and not clip), (clip, step)
            if clip:
                assert protrain_fx.clip_grad_norm_(compiled, 1.0) > 1.0

        train(compiled, "toy", 3, opt=opt, before_step=check)
        torch._dynamo.reset()


# per step, the max_norm of a run whose clip does not apply (1e6) or applies (0.05) in turn; with the first step
# deferred, the second and third start their host updates during the backward (the third clips, so they are
# undone and done again in step()), the fourth defers, the fifth starts them during the backward and undoes them
SPECULATION = [1e6, 1e6, 0.05, 1e6, 0.05]
SPECULATED = [False, True, True, False, True]


def speculative_clipping_equals_deferred(
    plan: dict, set_undo_reserve, device: str = "cpu", micro: int = 1, *, thorough: bool = True
) -> None:
    """Updates started during the backward of a clipped model (the last `n_clip_overlap` offloaded chunks, forced:
    all of them, and 3), kept, and undone where the clip applies: bitwise the weights, AdamW states and norms of
    deferring every update to `step()`, and the norms and losses of eager training. Without host room to keep
    them (`set_undo_reserve(share)` sets the share of the host's memory that must stay available:
    runtime/chunks/updates.py UNDO_HOST_RESERVE), updates defer. `micro` > 1: each step accumulates that many
    micro-batches (all but the last inside `protrain_fx.no_sync`), so the chunks' gradients arrive in parts.
    Not `thorough`: only all offloaded chunks overlapped, and no host-room check (CI time)."""

    def run(n_clip_overlap: int):
        ref, ref_opt, compiled, opt = _pair({**plan, "n_clip_overlap": n_clip_overlap}, device)
        norms, started = [], []
        # (its own loop: micro-batches accumulated with no_sync, clipped to a max_norm of each step's own)
        for step, max_norm in enumerate(SPECULATION):
            for i in range(micro):
                batch = {k: v.to(device) for k, v in models.batch("toy", seed=step * micro + i).items()}
                ref(**batch).backward()
                with protrain_fx.no_sync(compiled) if i < micro - 1 else contextlib.nullcontext():
                    compiled(**batch).backward()
            started.append(protrain_fx.manager_of(compiled).updates_started())
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            norm = protrain_fx.clip_grad_norm_(compiled, max_norm)
            assert (norm > max_norm) == (max_norm < 1), (step, norm)  # the schedule clips where it should
            assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-5), step
            norms.append(norm.item())
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad()
        for step in range(2):  # the losses after: eager training's
            batch = {k: v.to(device) for k, v in models.batch("toy", seed=10 + step).items()}
            assert compiled(**batch).item() == pytest.approx(ref(**batch).item(), rel=1e-5)
        weights, states = protrain_fx.full_state_dict(compiled), opt.state_dict()
        n_chunk = protrain_fx.manager_of(compiled).layout.n_chunk
        torch._dynamo.reset()
        return norms, started, weights, states, n_chunk

    set_undo_reserve(0.0)
    norms, started, weights, states, n_chunk = run(0)
    assert not any(started), started
    for n_clip_overlap in (n_chunk - plan["n_persist"], 3) if thorough else (n_chunk - plan["n_persist"],):
        norms_now, started_now, weights_now, states_now, _ = run(n_clip_overlap)
        last = list(range(n_chunk - n_clip_overlap, n_chunk))  # their gradients arrive first
        assert started_now == [last if s else [] for s in SPECULATED], (n_clip_overlap, started_now)
        assert norms_now == norms
        for name, value in weights.items():
            assert torch.equal(weights_now[name], value), (n_clip_overlap, name)
        for i, st in states["state"].items():
            for k, v in st.items():
                assert torch.equal(states_now["state"][i][k], v), (n_clip_overlap, i, k)
    if thorough:
        set_undo_reserve(1.0)
        assert not any(run(3)[1])


@pytest.mark.parametrize(
    "device, micro", [("cpu", 1), ("cpu", 2), pytest.param("cuda", 1, marks=pytest.mark.gpu)], ids=str
)
def test_speculative_host_updates_are_undone_where_clipping_applies(monkeypatch, device, micro):
    speculative_clipping_equals_deferred(
        PLANS["offloaded"],
        lambda share: monkeypatch.setattr(updates, "UNDO_HOST_RESERVE", share),
        device,
        micro,
        thorough=micro == 1,
    )


def test_speculative_host_updates_with_shared_gradient_shards(monkeypatch):
    """A speculated chunk keeps its shared gradient shard until its update is final."""
    speculative_clipping_equals_deferred(
        PLANS["shared-gradients"],
        lambda share: monkeypatch.setattr(updates, "UNDO_HOST_RESERVE", share),
        thorough=False,
    )


def _ranks_speculate(rank: int, world: int) -> None:
    speculative_clipping_equals_deferred(
        PLANS["offloaded"],
        lambda share: setattr(updates, "UNDO_HOST_RESERVE", share),
        thorough=False,
    )


def test_speculative_host_updates_across_ranks():
    """The same on two gloo ranks: each rank undoes its own shards' updates, by a coefficient all agree on."""
    spawn_gloo(_ranks_speculate, 2)


def test_clip_errors():
    _, _, compiled, opt = _pair(PLANS["offloaded"])
    # never clipped: the second step's updates start during the backward (its own loop: no step after that one)
    for step in range(2):
        compiled(**models.batch("toy", seed=step)).backward()
        if step == 0:
            opt.step()
            opt.zero_grad()
    with pytest.raises(RuntimeError, match="in every step, from the first"):
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


@pytest.mark.parametrize("plan", ["persistent", "offloaded"])
def test_torch_clip_reads_its_coefficient_once(plan, monkeypatch):
    """`torch.nn.utils.clip_grad_norm_` over chunked gradients (what the Trainer and accelerate call) scales each
    gradient by one coefficient tensor: it is read on the host once per clip, not once per gradient (each read
    syncs a GPU), and the clip equals eager's."""
    ref, ref_opt, compiled, opt = _pair(PLANS[plan])
    batch = models.batch("toy", seed=0)
    ref(**batch).backward()
    compiled(**batch).backward()
    reads = []
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: reads.append(t.shape) or cpu(t, *a, **k))
    norm = torch.nn.utils.clip_grad_norm_(compiled.parameters(), 1e-3)
    monkeypatch.undo()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    assert reads == [torch.Size([])]
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    for (name, p), q in zip(compiled.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.clone(), q.grad, rtol=1e-5, atol=1e-12, msg=name)
