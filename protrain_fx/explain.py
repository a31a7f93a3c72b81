"""What the backend decides, without training and after it.

    plan = protrain_fx.explain(model, {"input_ids": ids, "labels": ids})   # profile, plan, print(plan)
    plan = protrain_fx.plan_of(compiled_model)                             # the plan in force, after a step
    manager = protrain_fx.manager_of(model)                                # its chunks, once built

`explain` compiles a throwaway copy of the model's forward with the backend in explain mode: the graph is
captured, profiled (one real forward and backward of the example batch) and planned as training with
`protrain_fx.optim.AdamW` would plan it, and nothing is rewritten or moved: the model's parameters stay where
they are, and no optimizer is needed. Its profile and plan are kept in the plan cache as training's are (an entry
of their own), and a line says what came from there. Printed, its plan first says what capture found in each
graph: the block lists (their paths, lengths and block indices in the plan) and how many graph nodes lie outside
them, one line per graph; for a tiny T5:

    graph 0: block lists encoder.block (2 x T5Block, blocks 0-1), decoder.block (2 x T5Block, blocks 2-3); 63 of
    1216 graph nodes outside them (pre 2, between 23, post 38)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from protrain_fx.backend import PLANS_ATTR, ProTrainBackend
from protrain_fx.planner.plan import Plan
from protrain_fx.runtime.adopt import model_manager, user_model
from protrain_fx.runtime.chunks import ChunkManager


def explain(
    model: nn.Module,
    example_batch: Mapping[str, Any] | tuple,
    options: Mapping[str, Any] | None = None,
    *,
    dynamic: bool = False,
):
    """The plan the backend would train `model` with on batches like `example_batch` (a dict of keyword
    arguments of its forward, or a tuple of positional ones, with labels so that a loss comes out). `dynamic`:
    planned as for batches of every size, up to the options' `max_seq_len` and `max_batch_size` (defaults: the
    model's `max_position_embeddings` and the example's batch size); the plan's lines say the sizes it covers."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"explain() takes the model (an nn.Module), got {type(model).__name__}")
    if not isinstance(example_batch, (Mapping, tuple)):
        raise TypeError(
            "explain()'s example_batch must be a dict of the forward's keyword arguments or a tuple of its "
            f"positional ones, got {type(example_batch).__name__}"
        )
    backend = ProTrainBackend(dict(options or {}), explain=True)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    with torch.enable_grad():
        if isinstance(example_batch, Mapping):
            compiled(**example_batch)
        else:
            compiled(*example_batch)
    planned = [g for g in backend.graphs if g.plan is not None and g.param_map]
    if not planned:
        raise ValueError(
            "explain() found no trainable parameters in the compiled graphs: pass a model with parameters that "
            "require grad, and a batch its forward accepts"
        )
    plan = _main(planned, lambda g: (len(g.param_map), g.plan))
    lines = [f"graph {g.index}: {g.block_map.describe()}" for g in planned]
    lines += [f"graph {g.index} planned for sizes {g.shapes.describe()}" for g in planned if g.shapes is not None]
    lines += [f"graph {g.index}: {_cached(g.from_cache)}" for g in planned if g.from_cache]
    return Explained.of(plan, tuple(lines))


class Explained(Plan):
    """What `explain` returns: the plan, a `Plan` in every other respect (fields, JSON, replay), printed after one
    line per graph saying what capture found in it (`BlockMap.describe`: the block lists, and the graph nodes
    outside them). The lines are no dataclass field: they are no decision, and a replayed plan has none."""

    blocks: tuple[str, ...] = ()

    @classmethod
    def of(cls, plan: Plan, blocks: tuple[str, ...]) -> Explained:
        explained = cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})
        object.__setattr__(explained, "blocks", blocks)  # (a frozen dataclass: as its own __init__ sets fields)
        return explained

    def __str__(self) -> str:
        return "\n".join([*self.blocks, super().__str__()])


def plan_of(compiled_model: nn.Module) -> Plan:
    """The plan in force for a model compiled with the protrain backend (after its first training step); with
    graph breaks, the plan of the graph reading the most parameters. A graph with symbolic sizes, or one whose
    profile or plan came from the plan cache (backend/cache.py): its plan with a line saying the sizes it covers
    and what came from the cache (an `Explained`)."""
    model = getattr(compiled_model, "_orig_mod", compiled_model)
    plans = model.__dict__.get(PLANS_ATTR) if isinstance(model, nn.Module) else None
    if not plans:
        raise ValueError(
            "no protrain plan for this model yet: compile it with torch.compile(model, backend='protrain') and run "
            "one training step (forward and backward) first. If it ran one compiled, Dynamo ran its forward "
            "uncompiled: it does so, warning 'hit config.recompile_limit', once one function was compiled "
            "torch._dynamo.config.recompile_limit times in the process (for models built one after another, say); "
            "call torch._dynamo.reset() before compiling each new model"
        )
    plan = _main(plans, lambda entry: entry[:2])
    _, _, shapes, from_cache = next(entry for entry in reversed(plans) if entry[1] is plan)
    lines = ([f"planned for sizes {shapes.describe()}"] if shapes is not None else []) + (
        [_cached(from_cache)] if from_cache else []
    )
    return Explained.of(plan, tuple(lines)) if lines else plan


def _cached(from_cache: tuple[str, ...]) -> str:
    """What of a graph's plan came from the plan cache of an earlier run (backend/cache.py)."""
    return f"from the plan cache of an earlier run: {', '.join(from_cache)}"


def manager_of(model: nn.Module) -> ChunkManager | None:
    """The ChunkManager holding the parameters, gradients and AdamW states of `model` (or of its torch.compile
    wrapper) in chunks: built by the first training step with `protrain_fx.optim.AdamW`, or by
    `protrain_fx.prepare`; None before, and for a model trained without chunks."""
    return model_manager(user_model(model, "manager_of()"))


def _main(entries, key) -> Plan:
    """The plan of the entry reading the most parameters (the latest among equals: a recompile replaces)."""
    best = None
    for entry in entries:
        n_params, plan = key(entry)
        if best is None or n_params >= best[0]:
            best = (n_params, plan)
    return best[1]
