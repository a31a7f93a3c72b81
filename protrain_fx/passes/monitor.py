"""step_mark_pass: with a dump directory, the forward graph marks each training step's start for the StepMonitor
(runtime/monitor.py), which sets measured step time and peak memory beside the plan's predictions.

    before:  x = placeholder; ...
    after:   x = placeholder; protrain.step_mark(monitor, x); ...
"""

from __future__ import annotations

import torch
from torch import fx


def step_mark_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if ctx.stage != "forward" or ctx.monitor is None:
        return gm
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first = next((n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)), None)
    if first is None:
        return gm
    with graph.inserting_after(placeholders[-1]):
        graph.call_function(torch.ops.protrain.step_mark.default, (ctx.monitor.handle, first))
    graph.lint()
    gm.recompile()
    return gm
