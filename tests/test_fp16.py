"""float16 chunks with dynamic loss scaling (`protrain_fx.amp.GradScaler`) against a reference written out in
full: fp16 model, fp32 master weights, torch's fused AdamW dividing the gradients by the loss scale, the step
skipped and the scale halved when a gradient overflows. Tolerance: bitwise (CPU, the same kernels).
"""

import copy

import models
import pytest
import torch

import protrain_fx

PLANS = {"persistent": {}, "offloaded": {"n_persist": 1, "n_buffer": 2}}


def _reference(model, kind, steps, init_scale):
    """fp16 model, fp32 master copy, loss scaling by hand; returns losses, scales and skipped steps."""
    params = list(model.parameters())
    master = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1, fused=True)
    scale, losses, scales, skipped = init_scale, [], [], []
    for step in range(steps):
        loss = models.loss_of(kind, model(**models.batch(kind, seed=step)))
        (loss * scale).backward()
        grads = [p.grad.float() for p in params]
        found = any(not torch.isfinite(g).all() for g in grads)
        if not found:
            for m, g in zip(master, grads):
                m.grad = g
            opt.grad_scale, opt.found_inf = torch.full((), scale), torch.zeros(())
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
        for p in params:
            p.grad = None
        losses.append(loss.item())
        scales.append(scale)
        skipped.append(found)
        scale = scale * 0.5 if found else scale
    return losses, scales, skipped


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
