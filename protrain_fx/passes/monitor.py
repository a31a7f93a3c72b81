"""step_mark_pass: where the graph has a step monitor (runtime/monitor.py: with a dump directory, or for the closed
loop), the forward graph marks each training step's start, and the forward and backward graphs their ends, for
the StepMonitor, which sets measured step time, phases and peak memory beside the plan's predictions.

    forward before:  x = placeholder; ...; output(outs)
    forward after:   x = placeholder; protrain.step_mark(monitor, x, [s0, ...]); ...;
                     protrain.phase_mark(monitor, FORWARD_END, last); output(outs)
    backward after:  ...; protrain.phase_mark(monitor, BACKWARD_END, last); output(outs)

where `last` (`_last_values`) are the tensors the graph's work ends in, which order the end mark after it, and
`[s0, ...]` the graph's `SymInt` inputs (none where its sizes are fixed): the step's sizes.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from protrain_fx.passes.contract import BACKWARD, FORWARD, PassContext, graph_pass

FORWARD_END, BACKWARD_END = 1, 2  # the phase marks' `phase` (runtime/monitor.py StepMonitor.phase_mark)


@graph_pass(graphs=(FORWARD, BACKWARD), requires=("monitor",))
def step_mark_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Mark the step's start and the forward's and backward's ends for the step monitor (see the module
    docstring)."""
    if ctx.stage not in ("forward", "backward") or ctx.monitor is None:
        return gm
    graph = gm.graph
    if ctx.stage == "forward":
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        first = next((n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)), None)
        if first is None:
            return gm
        sizes = [n for n in placeholders if isinstance(n.meta.get("val"), torch.SymInt)]  # (symbolic sizes)
        with graph.inserting_after(placeholders[-1]):
            graph.call_function(torch.ops.protrain.step_mark.default, (ctx.monitor.handle, first, sizes))
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    phase = FORWARD_END if ctx.stage == "forward" else BACKWARD_END
    with graph.inserting_before(output):
        graph.call_function(
            torch.ops.protrain.phase_mark.default, (ctx.monitor.handle, phase, _last_values(graph, output))
        )
    graph.lint()
    gm.recompile()
    return gm


def _last_values(graph: fx.Graph, output: fx.Node) -> list[fx.Node]:
    """The tensors the end mark waits for, none of which it keeps alive longer than the graph does: the outputs,
    and the last tensor a node computes (a chunked backward's outputs may hold none: its gradients go to
    `reduce_grads`). Not what the side-effecting ops take: the mark would keep a swapped activation or a
    gradient on the device to the graph's end."""
    found = dict.fromkeys(a for a in tree_leaves(output.args) if _is_tensor(a))
    last = next((n for n in reversed(graph.nodes) if n.op == "call_function" and _is_tensor(n)), None)
    if last is not None:
        found[last] = None
    return list(found)


def _is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)
