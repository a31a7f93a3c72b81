"""What the backend decides, without training and after it.

    plan = protrain_fx.explain(model, {"input_ids": ids, "labels": ids})   # profile, plan, print(plan)
    plan = protrain_fx.plan_of(compiled_model)                             # the plan in force, after a step

`explain` compiles a throwaway copy of the model's forward with the backend in explain mode: the graph is
captured, profiled (one real forward and backward of the example batch) and planned as training with
`protrain_fx.optim.AdamW` would plan it, and nothing is rewritten or moved: the model's parameters stay where
they are, and no optimizer is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from protrain_fx.backend import PLANS_ATTR, ProTrainBackend
from protrain_fx.planner.plan import Plan


def explain(model: nn.Module, example_batch: Mapping[str, Any] | tuple, options: Mapping[str, Any] | None = None):
    """The plan the backend would train `model` with on batches like `example_batch` (a dict of keyword
    arguments of its forward, or a tuple of positional ones, with labels so that a loss comes out)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"explain() takes the model (an nn.Module), got {type(model).__name__}")
    if not isinstance(example_batch, (Mapping, tuple)):
        raise TypeError(
            "explain()'s example_batch must be a dict of the forward's keyword arguments or a tuple of its "
            f"positional ones, got {type(example_batch).__name__}"
        )
    backend = ProTrainBackend(dict(options or {}), explain=True)
    compiled = torch.compile(model, backend=backend, dynamic=False)
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
    return _main(planned, lambda g: (len(g.param_map), g.plan))


def plan_of(compiled_model: nn.Module) -> Plan:
    """The plan in force for a model compiled with the protrain backend (after its first training step); with
    graph breaks, the plan of the graph reading the most parameters."""
    model = getattr(compiled_model, "_orig_mod", compiled_model)
    plans = model.__dict__.get(PLANS_ATTR) if isinstance(model, nn.Module) else None
    if not plans:
        raise ValueError(
            "no protrain plan for this model yet: compile it with torch.compile(model, backend='protrain') and run "
            "one training step (forward and backward) first"
        )
    return _main(plans, lambda entry: entry)


def _main(entries, key) -> Plan:
    """The plan of the entry reading the most parameters (the latest among equals: a recompile replaces)."""
    best = None
    for entry in entries:
        n_params, plan = key(entry)
        if best is None or n_params >= best[0]:
            best = (n_params, plan)
    return best[1]
