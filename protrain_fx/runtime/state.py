"""Reading the weights of a model whose parameters live in chunks."""

from __future__ import annotations

import torch
from torch import nn

from protrain_fx.runtime.adopt import model_manager


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The current full values on the CPU, keyed exactly like `model.state_dict()`.

    A collective when parameters are sharded across ranks: every rank must call it. Chunks are fetched one
    at a time, so the device never holds more than one extra chunk. Accepts the model or its
    `torch.compile` wrapper.
    """
    model = getattr(model, "_orig_mod", model)
    manager = model_manager(model)
    entries = model.state_dict(keep_vars=True)
    values: dict[int, torch.Tensor] = {}
    if manager is not None:
        manager.wait_for_update()
        for chunk in range(manager.layout.n_chunk):
            flat = manager.full_values(chunk)
            for i, start, end in _chunk_params(manager, chunk):
                p = manager.params[i]
                values[id(p)] = flat[start:end].view(p.shape).clone()
    return {name: values[id(t)] if id(t) in values else t.detach().to("cpu", copy=True) for name, t in entries.items()}


def _chunk_params(manager, chunk: int) -> list[tuple[int, int, int]]:
    return [(i, s.offset, s.offset + s.numel) for i, s in enumerate(manager.slots) if s.chunk == chunk]
