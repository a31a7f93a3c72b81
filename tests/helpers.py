"""What the tests share: the training loop, plans and tolerances, and readers of a model's chunks."""

from __future__ import annotations

import copy

import models
import pytest
import torch

import protrain_fx

# one chunk persistent, the rest offloaded: chunks gathered in the forward, reduced and updated in the backward
OFFLOADED = {"n_persist": 1, "n_buffer": 3}
ALL_OFFLOADED = {"n_persist": 0, "n_buffer": 2}  # every chunk offloaded, through two buffers
PLANS = {
    "persistent": {},
    "offloaded": OFFLOADED,
    # the toy's 9 offloaded chunks sharing 2 host gradient shards, 2 persistent ones sharing 1 device gradient
    # buffer (runtime/chunks/slots.py): their steps hold every gradient
    "shared-gradients": {"n_persist": 2, "n_buffer": 3, "host_grad_slots": 2, "device_grad_slots": 1},
}
# sizes of the hardware measurement (profiler/hardware.py) small enough for the CPU tests, which test the
# measurement, not its figures
SMALL_HARDWARE = {
    "COPY_BYTES": 4 * 2**20,
    "ADAM_PARAMS": 2**20,
    "COLLECTIVE_BYTES": (2**16, 2**20),
    "CPU_COLLECTIVE_BYTES": (2**16, 2**20),
}
UNCHANGED = {"plan": {"n_swap": 0, "n_checkpoint": 0}}  # the graphs run as profiled: no block swapped or recomputed

# bf16 autocast on a GPU: matmuls round to bf16 (eps 2^-8 = 0.0039); a loss is a mean over many such values, so
# eager and compiled losses agree to a few eps: rtol 2e-2 over 5 steps. Against plain `torch.compile` the inductor
# executor runs the same kernels, but some of them (embedding backward) accumulate with atomics, which are not
# deterministic on a GPU: the same tolerance. (The eager executor must equal eager PyTorch bitwise.)
BF16_RTOL = 2e-2


def train(
    model,
    kind: str,
    steps: int,
    *,
    opt=None,
    lr: float = 1e-2,
    first_step: int = 0,
    seed: int = 0,
    device="cpu",
    autocast=None,
    batch=None,
    before_step=None,
    after_step=None,
) -> list[float]:
    """`steps` training steps of `model` (steps `first_step`.. on their fixed batches: `batch(step)`, by default
    `models.batch(kind, seed=step)`, moved to `device`), each the forward (under autocast to the dtype `autocast`,
    if given), `loss.backward()`, `opt.step()`, `opt.zero_grad()`; the losses. `opt`: the optimizer, by default
    torch's AdamW (`lr`, weight decay 0.1). Dropout's RNG is seeded once with `seed`, as a user would.
    `before_step(step)` runs between the backward and `opt.step()` (to clip, or read the gradients),
    `after_step(step)` after `opt.zero_grad()` (a scheduler's step, a measurement)."""
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    if batch is None:
        batch = lambda step: models.batch(kind, seed=step)  # noqa: E731
    torch.manual_seed(seed)
    losses = []
    for step in range(first_step, first_step + steps):
        inputs = {k: v.to(device) for k, v in batch(step).items()}
        with torch.autocast(device_type=torch.device(device).type, dtype=autocast, enabled=autocast is not None):
            loss = models.loss_of(kind, model(**inputs))
        loss.backward()
        if before_step is not None:
            before_step(step)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step)
        losses.append(loss.item())
    return losses


def eager_and_protrain(kind: str, steps: int, options=None, *, device="cpu", autocast=None, **model_kw):
    """Train the same model eagerly and through the protrain backend; return (eager, protrain, backend, model)."""
    ref = models.build(kind, **model_kw).to(device)
    model = copy.deepcopy(ref)
    backend = protrain_fx.ProTrainBackend({"executor": "eager"} if options is None else options)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    eager_losses = train(ref, kind, steps, device=device, autocast=autocast)
    protrain_losses = train(compiled, kind, steps, device=device, autocast=autocast)
    return (eager_losses, ref), (protrain_losses, model), backend


def train_against_autocast(ref, ref_opt, compiled, opt, steps: int = 5) -> None:
    """Eager fp32 `ref` (the llama test model) under bf16 autocast and the bf16 `compiled` one on the same GPU
    batches, each by its optimizer: losses within BF16_RTOL."""
    expected = train(ref, "llama", steps, opt=ref_opt, device="cuda", autocast=torch.bfloat16)
    losses = train(compiled, "llama", steps, opt=opt, device="cuda")
    assert losses == pytest.approx(expected, rel=BF16_RTOL)


def bf16_chunks_against_autocast(options: dict, steps: int = 5):
    """The 4-layer llama test model in bf16 compiled by protrain with `options` (its AdamW) against its fp32 copy
    under bf16 autocast (torch's fused AdamW), on the GPU: `train_against_autocast`. Returns the backend."""
    ref = models.build("llama", layers=4).cuda()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    backend = protrain_fx.ProTrainBackend(options)
    train_against_autocast(ref, ref_opt, torch.compile(model, backend=backend, dynamic=False), opt, steps)
    return backend


def saved_activation_bytes(compiled, model, batch, exclude=()) -> int:
    """Bytes of the storages a forward of `compiled` keeps for backward, seen by saved-tensor hooks: parameters,
    buffers, inputs and the storages of `exclude` are left out."""
    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *batch.values()]}
    known.update(t.untyped_storage().data_ptr() for t in exclude)
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in known:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(**batch)
    return sum(seen.values())


class CapturingBackend(protrain_fx.ProTrainBackend):
    """Keeps the first graph's real example inputs, to run its rewritten graphs again."""

    def __call__(self, gm, example_inputs):
        self.__dict__.setdefault("inputs", list(example_inputs))
        return super().__call__(gm, example_inputs)


def chunk_grads(model) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as its chunk holds it, copied to the CPU (whole chunks: one rank, or persistent
    chunks), once every gradient is reduced across ranks and every copy to the host has landed."""
    manager = protrain_fx.manager_of(model)
    assert manager is not None, "the model has no chunks"
    manager.finish_reduction()
    manager.wait_for_update()
    out = {}
    for name, p in getattr(model, "_orig_mod", model).named_parameters():
        slot = manager.slot_of(p)
        out[name] = (
            manager.storage.grad[slot.chunk][slot.offset : slot.offset + slot.numel].view(p.shape).to("cpu", copy=True)
        )
    return out
