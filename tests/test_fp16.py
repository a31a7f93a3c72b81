"""float16 chunks with dynamic loss scaling (`protrain_fx.amp.GradScaler`) against a reference written out in
full: fp16 model, fp32 master weights, torch's fused AdamW dividing the gradients by the loss scale, the step
skipped and the scale halved when a gradient overflows. Tolerance: bitwise (CPU, the same kernels); on a GPU
against torch.amp.GradScaler under float16 autocast, that of bf16 (helpers.BF16_RTOL). The training loops are the
tests' own: loss scaling is written into the loop, as a user writes it.
"""

import copy

import models
import pytest
import torch
from helpers import BF16_RTOL

import protrain_fx

PLANS = {"persistent": {}, "offloaded": {"n_persist": 1, "n_buffer": 2}}


def _reference(model, kind, steps, init_scale, max_norm=None):
    """fp16 model, fp32 master copy, loss scaling by hand; returns losses, scales and skipped steps (and the
    gradient norms, when clipped to `max_norm` as torch.amp.GradScaler.unscale_ and clip_grad_norm_ do)."""
    params = list(model.parameters())
    master = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1, fused=True)
    scale, losses, scales, skipped, norms = init_scale, [], [], [], []
    for step in range(steps):
        loss = models.loss_of(kind, model(**models.batch(kind, seed=step)))
        (loss * scale).backward()
        grads = [p.grad.float() for p in params]
        found = any(not torch.isfinite(g).all() for g in grads)
        if not found and max_norm is not None:  # unscaled, clipped, stepped without the scale
            for m, g in zip(master, grads):
                m.grad = g / scale
            norms.append(torch.nn.utils.clip_grad_norm_(master, max_norm).item())
            opt.step()
        elif not found:
            for m, g in zip(master, grads):
                m.grad = g
            opt.grad_scale, opt.found_inf = torch.full((), scale), torch.zeros(())
            opt.step()
        if not found:
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
        for p in params:
            p.grad = None
        losses.append(loss.item())
        scales.append(scale)
        skipped.append(found)
        scale = scale * 0.5 if found else scale
    return (losses, scales, skipped, norms) if max_norm is not None else (losses, scales, skipped)


@pytest.mark.parametrize("plan", PLANS, ids=list(PLANS))
def test_fp16_loss_scaling_matches_reference(plan):
    kind, steps = "llama", 6
    ref = models.build(kind).half()
    model = copy.deepcopy(ref)
    init_scale = 2.0**20  # overflows float16 gradients at first: the first steps are skipped
    expected = _reference(ref, kind, steps, init_scale)
    assert any(expected[2]) and not all(expected[2]), expected  # some steps skipped, some taken

    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = protrain_fx.amp.GradScaler(init_scale=init_scale)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": PLANS[plan]}))
    losses, scales, skipped = [], [], []
    for step in range(steps):
        loss = models.loss_of(kind, compiled(**models.batch(kind, seed=step)))
        scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        skipped.append(opt.last_step_skipped)
    assert (losses, scales, skipped) == expected
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("dtype, waits", [(torch.float16, True), (torch.bfloat16, False)])
def test_fp16_plans_time_every_update_in_step(dtype, waits):
    """With loss scaling (float16, by default) a gradient overflow skips the whole step, so every update waits
    for `AdamW.step()`: the plan is timed so (planner/cost.py `updates_wait`). bfloat16 updates as gradients
    land."""
    model = models.build("llama").to(dtype)
    protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": PLANS["offloaded"]})
    models.loss_of("llama", torch.compile(model, backend=backend)(**models.batch("llama"))).float().backward()
    assert backend.graphs[0].costs.updates_wait == waits


@pytest.mark.parametrize("plan", PLANS, ids=list(PLANS))
def test_fp16_clipping_matches_torch(plan):
    """scaler.unscale_(opt), then protrain_fx.clip_grad_norm_: the norm of the unscaled gradients, and training
    like torch's unscale_ + clip_grad_norm_ on fp32 master gradients. Our gradients keep the scale until the
    fused update divides it out, so rounding differs (in the last bit of a master weight, which moves a float16
    weight by an ulp now and then): losses to 1e-5, norms to 1e-4; skipped steps and scales exact."""
    kind, steps, max_norm = "llama", 6, 0.5
    ref = models.build(kind).half()
    model = copy.deepcopy(ref)
    init_scale = 2.0**20
    losses_ref, scales_ref, skipped_ref, norms_ref = _reference(ref, kind, steps, init_scale, max_norm)
    assert any(skipped_ref) and min(norms_ref) > max_norm  # clipping changes every update taken

    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = protrain_fx.amp.GradScaler(init_scale=init_scale)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": PLANS[plan]}))
    losses, scales, skipped, norms = [], [], [], []
    for step in range(steps):
        loss = models.loss_of(kind, compiled(**models.batch(kind, seed=step)))
        scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        scaler.unscale_(opt)
        norm = protrain_fx.clip_grad_norm_(model, max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        skipped.append(opt.last_step_skipped)
        if not skipped[-1]:
            norms.append(norm.item())
    assert (scales, skipped) == (scales_ref, skipped_ref)
    assert losses == pytest.approx(losses_ref, rel=1e-5)
    assert norms == pytest.approx(norms_ref, rel=1e-4)


def test_fp16_clipping_needs_unscale():
    model = models.build("llama").half()
    opt = protrain_fx.optim.AdamW(model.parameters())
    scaler = protrain_fx.amp.GradScaler()
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": {}}))
    scaler.scale(compiled(**models.batch("llama")).loss).backward()
    with pytest.raises(ValueError, match=r"call scaler.unscale_\(optimizer\) before clip_grad_norm_"):
        protrain_fx.clip_grad_norm_(model, 1.0)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)


def test_grad_scaler_errors():
    with pytest.raises(ValueError, match="backoff_factor < 1"):
        protrain_fx.amp.GradScaler(backoff_factor=2.0)
    with pytest.raises(TypeError, match="use torch.amp.GradScaler for other optimizers"):
        protrain_fx.amp.GradScaler().step(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0))
    model = models.build("toy")
    opt = protrain_fx.optim.AdamW(model.parameters())
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": {}}))
    compiled(**models.batch("toy")).backward()
    with pytest.raises(ValueError, match="loss scaling .* is for float16 models"):
        protrain_fx.amp.GradScaler().step(opt)


@pytest.mark.gpu
def test_fp16_chunks_with_loss_scaling():
    """float16 weights in chunks (one on the GPU, the rest offloaded) with protrain_fx.amp.GradScaler, against
    eager fp32 training under float16 autocast with torch.amp.GradScaler: the same tolerance as bf16."""
    ref = models.build("llama", layers=4).cuda()
    model = copy.deepcopy(ref).half()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    ref_scaler = torch.amp.GradScaler("cuda")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = protrain_fx.amp.GradScaler()
    options = {"plan": {"n_persist": 1, "n_buffer": 2}}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    for step in range(5):
        batch = {k: v.cuda() for k, v in models.batch("llama", seed=step).items()}
        with torch.autocast("cuda", dtype=torch.float16):
            ref_loss = ref(**batch).loss
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        loss = compiled(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=BF16_RTOL), f"step {step}"
