"""Bringing a model under chunk management: when, in which order, and where the manager is kept.

A model is managed in chunks when its parameters belong to a `protrain_fx.optim.AdamW` (only that optimizer
can step parameters whose gradients live in chunks). The first compiled graph holding its parameters
builds the layout and the `ChunkManager`; the manager is kept on the model object, so every later graph
of the same model (graph breaks) shares it.

Order of the layout: the parameters of the first graph by first use, then any other trainable parameter of
the model in registration order (a later graph's, which the first graph cannot see).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from protrain_fx.capture import FrameRoots, block_index
from protrain_fx.planner.chunking import ChunkLayout, ParamInfo, search_layout
from protrain_fx.planner.plan import Plan
from protrain_fx.runtime.chunks import ChunkManager, rank_and_world_size
from protrain_fx.runtime.optim import OPTIMIZER_ATTR

log = logging.getLogger(__name__)

MODEL_ATTR = "_protrain_chunk_manager"  # on the model object: its ChunkManager


def model_manager(model: nn.Module | None) -> ChunkManager | None:
    return None if model is None else model.__dict__.get(MODEL_ATTR)


def wants_chunks(params: Sequence[nn.Parameter]) -> bool:
    return any(OPTIMIZER_ATTR in p.__dict__ for p in params)


def _ordered_params(roots: FrameRoots, record, example_inputs: Sequence[Any]) -> list[tuple[str, nn.Parameter]]:
    entries = sorted(
        record.param_map.values(),
        key=lambda e: (e.first_use_index is None, e.first_use_index or 0),
    )
    ordered = [(e.name, example_inputs[e.index]) for e in entries if example_inputs[e.index].requires_grad]
    seen = {id(p) for _, p in ordered}
    for name, p in roots.model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            ordered.append((name, p))
            seen.add(id(p))
    return ordered


def model_layout(roots: FrameRoots, record, example_inputs: Sequence[Any], forced: Mapping[str, Any]) -> ChunkLayout:
    """The chunk layout of the whole model (see the module docstring)."""
    ordered = _ordered_params(roots, record, example_inputs)
    dtypes = {p.dtype for _, p in ordered}
    if len(dtypes) != 1:
        raise ValueError(
            f"trainable parameters have several dtypes {sorted(map(str, dtypes))}; chunks hold one dtype: "
            "cast the model to one (e.g. model.to(torch.bfloat16))"
        )
    family = record.block_map.family
    infos = [
        ParamInfo(name=n, numel=p.numel(), block=block_index(n.split("."), family) if family else None)
        for n, p in ordered
    ]
    _, world_size = rank_and_world_size()
    layout = search_layout(infos, ordered[0][1].element_size(), world_size, chunk_bytes=forced.get("chunk_bytes"))
    log.info(
        "chunk layout: %d chunks of %.2f MiB, %.2f MiB padding",
        layout.n_chunk,
        layout.chunk_bytes / 2**20,
        layout.waste_bytes / 2**20,
    )
    return layout


def build_manager(model: nn.Module, layout: ChunkLayout, plan: Plan) -> ChunkManager:
    by_name = dict(model.named_parameters())
    params = [by_name[slot.name] for slot in layout.slots]
    with unset_fake_temporarily():  # called from the partitioner, under AOTAutograd's fake mode
        manager = ChunkManager(params, layout, n_persist=plan.n_persist, n_buffer=plan.n_buffer)
    model.__dict__[MODEL_ATTR] = manager
    return manager
