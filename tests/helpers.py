"""Training loops shared by the parity tests."""

from __future__ import annotations

import copy

import models
import torch

import protrain_fx
from protrain_fx.runtime.adopt import model_manager


def train(model, kind: str, steps: int, *, seed: int = 0, lr: float = 1e-2, device="cpu", autocast=None):
    """`steps` AdamW steps on fixed batches; returns the losses. Dropout RNG is seeded once, like a user would."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    torch.manual_seed(seed)
    losses = []
    for step in range(steps):
        batch = {k: v.to(device) for k, v in models.batch(kind, seed=step).items()}
        with torch.autocast(device_type=torch.device(device).type, dtype=autocast, enabled=autocast is not None):
            loss = models.loss_of(kind, model(**batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().cpu())
    return losses


def train_steps(model, opt, kind: str, steps: int, first_step: int = 0) -> list[float]:
    """Steps `first_step` .. `first_step + steps - 1` of `opt` on their batches; the losses."""
    losses = []
    for step in range(first_step, first_step + steps):
        loss = models.loss_of(kind, model(**models.batch(kind, seed=step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
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


def losses_side_by_side(kind, ref, ref_opt, compiled, opt, steps: int = 3) -> list[tuple[float, float]]:
    """(reference loss, compiled loss) per step, each model trained by its optimizer on the same batches."""
    pairs = []
    for step in range(steps):
        losses = []
        for m, o in ((ref, ref_opt), (compiled, opt)):
            loss = models.loss_of(kind, m(**models.batch(kind, seed=step)))
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        pairs.append(tuple(losses))
    return pairs


class CapturingBackend(protrain_fx.ProTrainBackend):
    """Keeps the first graph's real example inputs, to run its rewritten graphs again."""

    def __call__(self, gm, example_inputs):
        self.__dict__.setdefault("inputs", list(example_inputs))
        return super().__call__(gm, example_inputs)


def manager_of(model):
    """The ChunkManager of a model (or of its torch.compile wrapper) trained with protrain_fx.optim.AdamW."""
    manager = model_manager(getattr(model, "_orig_mod", model))
    assert manager is not None, "the model has no chunks"
    return manager


def chunk_grads(model) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as its chunk holds it, copied to the CPU (whole chunks: one rank, or persistent
    chunks), once every gradient is reduced across ranks and every copy to the host has landed."""
    manager = manager_of(model)
    manager.finish_reduction()
    manager.wait_for_update()
    out = {}
    for name, p in getattr(model, "_orig_mod", model).named_parameters():
        slot = manager.slot_of(p)
        out[name] = manager.grad[slot.chunk][slot.offset : slot.offset + slot.numel].view(p.shape).to("cpu", copy=True)
    return out
