"""A graph's profile at sizes it was not run at (a graph with symbolic batch and sequence sizes, shapes.py).

Such a graph is profiled at two sizes, `a` (its first call's) and `b`; `ProfileFit.at(x)` gives the profile at any
sizes `x`, node by node, from the graph's symbolic shapes and the two measurements:

    latency_s            c + k * work(x), fitted through a and b (k >= 0), where work is the node's largest
                         tensor's element count (an attention kernel's: its query's times the key length)
    allocated_before     measured at a, plus live(x) - live(a): the bytes of the values alive before the node
                         (each storage once, from its maker to its last reader, as the profiling run frees them)
    intra/inter delta    measured at a, times the bytes of the node's storages at x over at a (its work's
                         where it makes none)
    output, saved, kept  measured at a, times the bytes of the node's storages at x over at a
    fused, unfused bytes inductor's kernels at x (profiler/fusion.py)

The planner reads the result as it reads a measured profile.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Mapping

import sympy
import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from protrain_fx.profiler.fusion import kernel_classes
from protrain_fx.profiler.profile import GraphProfile, aggregate_blocks
from protrain_fx.shapes import Sizes, SizesAt, expr_of

# kernels whose work grows as the query's elements times the key length, beyond any tensor they read or write
ATTENTION_KERNELS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


@dataclasses.dataclass(frozen=True)
class _GraphSizes:
    """One graph's sizes as expressions of its symbols: per call node its work (its largest tensor's elements, the
    basis of its time and workspace) and the bytes of the storages it makes; and each storage's bytes with the
    positions it is alive over."""

    work: dict[str, sympy.Expr]
    storage: dict[str, sympy.Expr]
    position: dict[str, int]  # call node -> its position in the graph
    alive: list[tuple[int, int, sympy.Expr]]  # (first position alive, last position, bytes)

    def live(self, x: SizesAt) -> dict[str, int]:
        """Per call node, the bytes alive just before it runs, at sizes `x`."""
        delta = [0] * (max(self.position.values(), default=0) + 2)
        for start, stop, size in self.alive:
            if start < len(delta):
                n = x(size)
                delta[start] += n
                delta[min(stop + 1, len(delta) - 1)] -= n
        running = list(itertools.accumulate(delta))
        return {name: running[i] for name, i in self.position.items()}


class ProfileFit:
    """The profiles of one graph measured at sizes `a` and `b`, and its profile at any sizes (module docstring)."""

    def __init__(self, graphs: Mapping[str, fx.GraphModule], measured: tuple[tuple[Sizes, GraphProfile], ...]):
        assert len(measured) == 2, "a fit takes the profiles at two sizes"
        (self.a, self.profile_a), (self.b, self.profile_b) = measured
        self._at_a, self._at_b = SizesAt(self.a), SizesAt(self.b)  # (what every `at` reads at the sizes measured)
        self.graphs = dict(graphs)
        self.cpu = self.profile_a.device.startswith("cpu")
        self.sizes = {kind: _graph_sizes(gm.graph) for kind, gm in self.graphs.items()}
        # the forward's inputs the backward does not take: its caller holds them through the backward too
        taken = {n.name for n in self.graphs["backward"].graph.find_nodes(op="placeholder")}
        held = self.graphs["forward"].graph.find_nodes(op="placeholder")
        self.held_inputs = sum((_storage_bytes(n) for n in held if n.name not in taken), sympy.Integer(0))

    def at(self, sizes: Sizes) -> GraphProfile:
        """The profile at sizes `sizes`."""
        a, b, x, pa = self._at_a, self._at_b, SizesAt(sizes), self.profile_a
        latency_b = {(n.graph, n.name): n.latency_s for n in self.profile_b.nodes}
        kernels = {kind: kernel_classes(gm.graph, cpu=self.cpu, sizes=x) for kind, gm in self.graphs.items()}
        live = {kind: (s.live(a), s.live(x)) for kind, s in self.sizes.items()}
        held = [v(self.held_inputs) for v in (a, x)]
        nodes = []
        for n in pa.nodes:
            s = self.sizes[n.graph]
            work = [v(s.work[n.name]) for v in (a, b, x)]
            storage = [v(s.storage[n.name]) for v in (a, x)]
            live_a, live_x = (v[n.name] for v in live[n.graph])
            if n.graph == "backward":
                live_x += held[1] - held[0]
            grows = storage if storage[0] else (work[0], work[2])  # (a transient grows as what the node makes)
            k = kernels[n.graph].get(n.name)
            nodes.append(
                dataclasses.replace(
                    n,
                    latency_s=_line(work, (n.latency_s, latency_b[n.graph, n.name])),
                    allocated_before=n.allocated_before + live_x - live_a,
                    intra_delta_bytes=_scaled(n.intra_delta_bytes, *grows),
                    inter_delta_bytes=_scaled(n.inter_delta_bytes, *grows),
                    output_bytes=_scaled(n.output_bytes, *storage),
                    saved_bytes=_scaled(n.saved_bytes, *storage),
                    kept_bytes=_scaled(n.kept_bytes, *storage),
                    fused_bytes=k.fused_bytes if k is not None else n.fused_bytes,
                    unfused_bytes=k.unfused_bytes if k is not None else n.unfused_bytes,
                )
            )
        fw = [r for r in pa.nodes if r.graph == "forward"]  # (before the first node: the inputs)
        inputs = [v[fw[0].name] for v in live["forward"]] if fw else [0, 0]
        baseline = pa.baseline_bytes + inputs[1] - inputs[0]
        peak = max([baseline, *(r.allocated_before + max(r.intra_delta_bytes, r.inter_delta_bytes, 0) for r in nodes)])
        return dataclasses.replace(
            pa,
            forward_s=sum(r.latency_s for r in nodes if r.graph == "forward"),
            backward_s=sum(r.latency_s for r in nodes if r.graph == "backward"),
            peak_bytes=peak,
            baseline_bytes=baseline,
            saved_bytes=sum(r.saved_bytes for r in nodes),
            nodes=nodes,
            blocks=aggregate_blocks(nodes),
            reserved_bytes=int(pa.reserved_bytes * peak / pa.peak_bytes) if pa.peak_bytes else pa.reserved_bytes,
            measured_peak_bytes=pa.measured_peak_bytes + peak - pa.peak_bytes,
        )


def _line(work: list[int], latency: tuple[float, float]) -> float:
    """The latency at work[2] on the line through (work[0], latency[0]) and (work[1], latency[1]), rising or flat;
    the latency at a where the node's work does not depend on the sizes."""
    if work[0] == work[1]:
        return latency[0]
    slope = max(0.0, (latency[1] - latency[0]) / (work[1] - work[0]))
    return max(0.0, latency[0] + slope * (work[2] - work[0]))


def _scaled(value: int, at_a: int, at_x: int) -> int:
    return int(value * at_x / at_a) if at_a else value


def _tensors(node: fx.Node) -> list[torch.Tensor]:
    return [t for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]


def _work(node: fx.Node) -> sympy.Expr:
    """The node's largest tensor's elements (among what it reads and makes); an attention kernel's query elements
    times the key length."""
    name = str(node.target)
    if any(k in name for k in ATTENTION_KERNELS) and len(node.args) > 1:
        q, k = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2])
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and k.dim() >= 2:
            return expr_of(q.numel()) * expr_of(k.shape[-2])
    tensors = [t for n in [node, *node.all_input_nodes] for t in _tensors(n)]
    exprs = [expr_of(t.numel()) for t in tensors]
    return sympy.Max(*exprs) if exprs else sympy.Integer(0)


def _storage_bytes(node: fx.Node) -> sympy.Expr:
    return sum((expr_of(t.untyped_storage().nbytes()) for t in _tensors(node)), sympy.Integer(0))


def _is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target is operator.getitem or getattr(node.target, "is_view", False))


def _graph_sizes(graph: fx.Graph) -> _GraphSizes:
    """`graph`'s sizes (`_GraphSizes`). A view belongs to the storage it views; a storage lives from its maker to
    the last reader of it or of any of its views (to the end where the graph returns it), as the profiling run
    frees it; placeholders live throughout (the caller holds them), but for a backward's saved activations, freed
    after their last reader as AOTAutograd's boxed call frees them."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        base = n.args[0] if _is_alias(n) and n.args and isinstance(n.args[0], fx.Node) else None
        root[n] = root.get(base, n) if base is not None else n
    end = len(nodes)
    backward = any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder"))
    last: dict[fx.Node, int] = {}
    for n in nodes:
        r = root[n]
        last[r] = max(last.get(r, order[r]), order[n])
        for user in n.users:
            last[r] = max(last[r], end if user.op == "output" else order[user])
        if n.op == "placeholder" and not (backward and not n.name.startswith(("primals", "tangents"))):
            last[r] = end
    alive = [(0 if r.op == "placeholder" else order[r] + 1, stop, _storage_bytes(r)) for r, stop in last.items()]
    calls = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    return _GraphSizes(
        work={n.name: _work(n) for n in calls},
        storage={n.name: _storage_bytes(n) for n in calls},
        position={n.name: order[n] for n in calls},
        alive=[(start, stop, size) for start, stop, size in alive if size != 0],
    )
