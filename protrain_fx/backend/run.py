"""`ChunkedRun`: what Dynamo calls for one compiled graph of a chunked model, and `lent_at_break`: the parameters a
graph that ends in a graph break inside modules lends to the Python running the rest of their forward."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch._guards
from torch import fx
from torch._dynamo.guards import GuardBuilder
from torch._dynamo.source import LocalSource

from protrain_fx.backend.record import GraphRecord
from protrain_fx.capture import find_frame_roots, frame_self, open_modules
from protrain_fx.runtime.chunks import MANAGER_ATTR


def lent_at_break(dynamo_gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[object, list[int]] | None:
    """A graph that ends in a graph break inside modules (capture.open_modules): Python runs the rest of their
    forward, maybe outside any compiled graph (a loop over data-dependent values), so once the graph has run, their
    offloaded parameters get their values (`Outside.lend_to_python`, runtime/chunks/outside.py). Their manager and
    indices, or None."""
    reason = getattr(dynamo_gm, "compile_subgraph_reason", None)
    if reason is None or not reason.graph_break:
        return None
    own = [
        p
        for m in open_modules(dynamo_gm, find_frame_roots(dynamo_gm, example_inputs))
        for p in m.parameters(recurse=False)
    ]
    manager = next((p.__dict__[MANAGER_ATTR] for p in own if MANAGER_ATTR in p.__dict__), None)
    if manager is None:  # (the chunks of a model are built at its first graph: none before)
        return None
    indices = sorted({manager.index[id(p)] for p in own if manager.holds(p) and not manager.is_persistent(p)})
    if not indices:
        return None
    context = torch._guards.TracingContext.try_get()
    if context is not None and frame_self() is not None:  # (these modules' parameters, not another's)
        context.guards_context.dynamo_guards.add(LocalSource("self").make_guard(GuardBuilder.ID_MATCH))
    return manager, indices


class ChunkedRun:
    """What Dynamo calls for one compiled graph of a chunked model: the graph, after checking that its parameter
    inputs are still the chunks' (a parameter replaced after the chunks were built is an error, not silently
    stale values; checked on what Dynamo passes, before a compiler copies an input into another layout), and
    followed by lending parameters to Python where the graph ends inside a module's forward (`lent_at_break`)."""

    def __init__(self, compiled, record: GraphRecord, example_inputs: Sequence[Any], lend):
        self.compiled = compiled
        manager = record.manager() if record.manager is not None else None
        entries = [
            e for e in record.param_map.values() if manager is not None and manager.holds(example_inputs[e.index])
        ]
        self.positions = [e.index for e in entries]
        self.indices = [manager.index[id(example_inputs[e.index])] for e in entries]
        self.manager = record.manager
        self.lend = (weakref.ref(lend[0]), lend[1]) if lend is not None else None

    def __call__(self, *args):
        manager = self.manager() if self.manager is not None else None
        if manager is not None:
            manager.check_params(self.indices, [args[i] for i in self.positions])
        out = self.compiled(*args)
        lender = self.lend[0]() if self.lend is not None else None
        if lender is not None:
            lender.outside.lend_to_python(self.lend[1], for_backward=torch.is_grad_enabled())
        return out
