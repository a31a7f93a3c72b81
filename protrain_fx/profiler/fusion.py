"""What a fusing compiler (inductor) makes of a graph's nodes: which run as library kernels and which are fused.

The profile times each node as its own kernel, which is what the eager executor runs. Inductor runs the same
library kernels for matrix products, attention and its fallback ops ("extern" nodes), but fuses the other
nodes between them into generated kernels that each read their inputs and write their outputs once. So under
inductor a fused region costs about the bytes it moves divided by the device's memory bandwidth, whatever its
nodes cost one by one (well under their profiled node-by-node time).

`kernel_classes(graph)` returns, per node name, a `Kernel`: its class, fused bytes and unfused bytes (`describe`
and `rebuild` carry a graph to and from JSON with what this reads, so a dump can be classified again later):
  "extern": a library kernel; its profiled time stands.
  "view": a view, a getitem or any node that makes no new tensor; free.
  "fused": part of a fused region. Regions are the connected groups of fused nodes (views passed through) at
      the same "extern depth" (the most extern nodes on any path from the graph inputs), since a kernel cannot
      hold two nodes with a library kernel between them. A region's bytes, the tensors it reads from outside
      and the tensors it writes (that anything outside reads, and values inductor stores rather than recomputes:
      `_realized`), are put on its last node; its other nodes get 0.
  unfused_bytes: the tensors made inside a fused region and read only there (a fused kernel keeps them in
      registers) that are alive at the node in the op-by-op profile, less the tensors from outside the region
      that the profile has freed at their last read inside it but the region's kernel still reads (alive
      until the region's end); the memory model takes them out of the profiled peak there.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import operator
import re
from collections.abc import Mapping
from typing import Any

import networkx as nx
import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from protrain_fx.shapes import Sizes, SizesAt, hint, size_at

EXTERN = "extern"
FUSED = "fused"
VIEW = "view"

_aten = torch.ops.aten
# lowered by inductor, but to a call of a library kernel (cuBLAS, cuDNN), not to generated code
_LIBRARY_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
    _aten.convolution_backward.default,
}
_CALL_OPS = ("call_function", "call_method", "call_module")
# ops (profile targets) whose kernels are bound by arithmetic, not memory: matmuls, convolutions, fused attention.
# A device at its power limit slows them (planner/cost.py); beside them the device's AdamW, bound by memory, runs
# partly hidden (`CostModel._gpu_optim_s`)
_MATMUL_OPS = re.compile(
    r"aten\.(mm|addmm|bmm|baddbmm|convolution|convolution_backward|_scaled_dot_product_\w*attention\w*"
    r"|_flash_attention_\w+|_efficient_attention_\w+)\."
)


def is_matmul(target: str) -> bool:
    """Whether a node of this target (`NodeProfile.target`) runs a kernel bound by arithmetic."""
    return _MATMUL_OPS.match(target) is not None


def is_library(target) -> bool:
    """Whether inductor runs an op of this target (a node's) as a library or fallback kernel, not generated code."""
    return _is_extern(target)


def _is_extern(target) -> bool:
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import fallbacks, lowerings

    if not isinstance(target, torch._ops.OpOverload):
        return not _is_alias(target)  # custom Python callables run as they are
    if target in _LIBRARY_OPS:
        return True
    if target in select_decomp_table():  # decomposed into ops inductor fuses (log-softmax, nll loss, norms)
        return False
    return target in fallbacks or target not in lowerings


def _is_alias(target) -> bool:
    return target is operator.getitem or getattr(target, "is_view", False)


def _nbytes(node: fx.Node, sizes: Sizes | SizesAt | None = None) -> int:
    """Bytes of the node's tensors, at `sizes` where the graph's sizes are symbolic (at their hints if None)."""
    return sum(size_at(t.numel(), sizes) * t.element_size() for t in _tensors(node))


def _numel(node: fx.Node) -> int:
    return sum(hint(t.numel()) for t in _tensors(node))


def _tensors(node: fx.Node) -> list[torch.Tensor]:
    return [t for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]


def _freed_after_use(node: fx.Node, backward: bool) -> bool:
    """The graph's run frees the tensor after its last read: every computed value, and in a backward (a graph
    with output gradients, `tangents_*`) its saved activations. Inputs that stay alive: a forward's inputs,
    saved parameters and inputs (`primals_*`, held by the model) and output gradients (held by the engine)."""
    if node.op != "placeholder":
        return True
    return backward and not node.name.startswith(("primals", "tangents"))


@dataclasses.dataclass(frozen=True)
class Kernel:
    kind: str  # EXTERN | FUSED | VIEW
    fused_bytes: int = 0  # a region's last node: the bytes the region's kernel moves
    # bytes the profile holds at this node that the fused kernels never allocate, less the bytes they still hold
    # that the profile has freed (negative where those are more)
    unfused_bytes: int = 0


# inductor's config.realize_reads_threshold: a pointwise value read by several nodes is written out once rather
# than recomputed in each when computing it reads more than this many buffers
REALIZE_READS = 4
# on the CPU inductor also writes out a value read by several nodes when computing it takes one of these
_HEAVY_ON_CPU = {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}


def _realized(nodes, kind, root, readers, *, cpu: bool) -> set[fx.Node]:
    """The fused nodes inductor writes out although only its fused kernels read them (ir.py:
    `should_realize_on_reuse`): values read by several nodes whose expression reads more than REALIZE_READS
    buffers (or, on the CPU, takes a heavy op). A cheap value read twice, like a cast of the logits, is
    recomputed in each reader and never stored."""
    realized: set[fx.Node] = set()
    reads: dict[fx.Node, frozenset] = {}  # fused node -> the stored tensors its inlined expression reads
    heavy: dict[fx.Node, bool] = {}  # fused node -> its inlined expression takes a heavy op
    reduction: set[fx.Node] = set()  # computed in a loop of its own: what reads it reads one value
    for n in nodes:
        if kind[n] != FUSED:
            continue
        inputs = [root[p] for p in n.all_input_nodes]
        inlined = [p for p in inputs if kind.get(p) == FUSED and p not in realized and p not in reduction]
        reads[n] = frozenset().union(*(reads[p] if p in inlined else {p} for p in inputs))
        heavy[n] = getattr(n.target, "__name__", "").split(".")[0] in _HEAVY_ON_CPU or any(heavy[p] for p in inlined)
        if len(readers.get(n, ())) > 1 and (len(reads[n]) > REALIZE_READS or (cpu and heavy[n])):
            realized.add(n)
        if any(_numel(n) < _numel(p) for p in inputs):
            reduction.add(n)
    return realized


def kernel_classes(graph: fx.Graph, *, cpu: bool = False, sizes: Sizes | SizesAt | None = None) -> dict[str, Kernel]:
    """Every call node's `Kernel` (see the module docstring), from the graph's shapes alone; `cpu`: inductor
    generates CPU code for it, which stores a few more values (`_realized`); `sizes`: the values of a graph's
    symbolic sizes the bytes are counted at (their hints if None)."""
    nodes = [n for n in graph.nodes if n.op in _CALL_OPS]
    root: dict[fx.Node, fx.Node] = {}  # a view -> the node whose tensor it views (itself for others)
    for n in graph.nodes:
        base = n.args[0] if n.op in _CALL_OPS and _is_alias(n.target) and n.args else None
        root[n] = root.get(base, n) if isinstance(base, fx.Node) else n
    kind = {n: VIEW if root[n] is not n else EXTERN if _is_extern(n.target) else FUSED for n in nodes}
    depth: dict[fx.Node, int] = {}
    for n in graph.nodes:
        preds = [root[p] for p in n.all_input_nodes]
        depth[n] = max((depth[p] + (kind.get(p) == EXTERN) for p in preds), default=0)

    regions = nx.Graph()
    regions.add_nodes_from(n for n in nodes if kind[n] == FUSED)
    for n in nodes:
        if kind[n] != FUSED:
            continue
        for p in n.all_input_nodes:
            p = root[p]
            if kind.get(p) == FUSED and depth[p] == depth[n]:
                regions.add_edge(p, n)

    readers: dict[fx.Node, set[fx.Node]] = {}  # root tensor -> the non-view nodes (or output) that read it
    for n in graph.nodes:
        if n.op in _CALL_OPS and kind[n] == VIEW:
            continue
        for p in n.all_input_nodes:
            readers.setdefault(root[p], set()).add(n)

    realized = _realized(nodes, kind, root, readers, cpu=cpu)
    backward = any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder"))
    out = {n.name: Kernel(kind[n]) for n in nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    # (from, to, bytes) of tensors only the profile holds (negative bytes: only the fused kernels hold them)
    internal: list[tuple[int, int, int]] = []
    for members in nx.connected_components(regions):
        read = {root[p] for n in members for p in n.all_input_nodes if root[p] not in members}
        written = {n for n in members if any(r not in members for r in readers.get(n, ())) or n in realized}
        last = max(members, key=order.__getitem__)
        out[last.name] = Kernel(FUSED, fused_bytes=sum(_nbytes(t, sizes) for t in read | written))
        for n in members - written:
            internal.append((order[n], max(order[r] for r in readers.get(n, {n})), _nbytes(n, sizes)))
        # and the opposite: a tensor from outside that the profile frees at its last read inside the region, while
        # the region's kernel still reads it until the region's end (the saved logits in the loss's backward)
        for p in read:
            last_read = max(order[r] for r in readers[p])
            if last_read < order[last] and _freed_after_use(p, backward):
                internal.append((last_read + 1, order[last], -_nbytes(p, sizes)))
    # what the profile holds at each node that the fused kernels never allocate, less what they hold that the
    # profile does not: a tensor over its positions (a running sum over graph positions)
    delta = [0] * (len(order) + 1)
    for made, read, size in internal:
        delta[made] += size
        delta[read + 1] -= size
    alive = list(itertools.accumulate(delta))
    for n in nodes:
        out[n.name] = dataclasses.replace(out[n.name], unfused_bytes=alive[order[n]])
    return out


def classify(records: Mapping[str, Any], graph: fx.Graph, *, cpu: bool = False, sizes: Sizes | None = None) -> None:
    """Write each call node's `Kernel` into the record of its name (a profile's NodeProfile: its `kernel`,
    `fused_bytes` and `unfused_bytes`), at the graph's `sizes`; nodes without a record are left out."""
    for name, k in kernel_classes(graph, cpu=cpu, sizes=sizes).items():
        if name in records:
            record = records[name]
            record.kernel, record.fused_bytes, record.unfused_bytes = k.kind, k.fused_bytes, k.unfused_bytes


def describe(graph: fx.Graph) -> list[dict]:
    """The graph as `kernel_classes` reads it, for JSON (a dump's graphs.json): per node its name, op, target,
    input nodes (in argument order) and the shape and dtype of each tensor it makes."""
    nodes = []
    for n in graph.nodes:
        tensors = [t for t in tree_leaves(n.meta.get("val")) if isinstance(t, torch.Tensor)]
        nodes.append(
            {
                "name": n.name,
                "op": n.op,
                "target": _target_name(n.target) if n.op in (*_CALL_OPS, "get_attr") else None,
                "inputs": [p.name for p in n.all_input_nodes],
                "tensors": [[[hint(d) for d in t.shape], str(t.dtype).removeprefix("torch.")] for t in tensors],
            }
        )
    return nodes


def rebuild(nodes: list[dict]) -> fx.Graph:
    """A graph `kernel_classes` classifies as it did the one `describe` was given: the same nodes, edges and
    tensor sizes (meta tensors; each node's arguments are its input nodes only)."""
    graph = fx.Graph()
    made: dict[str, fx.Node] = {}
    for d in nodes:
        args = tuple(made[name] for name in d["inputs"])
        if d["op"] == "placeholder":
            node = graph.placeholder(d["name"])
        elif d["op"] == "output":
            graph.output(args)
            continue
        elif d["op"] == "get_attr":
            node = graph.create_node("get_attr", d["target"], name=d["name"])
        else:
            target = _resolve(d["target"]) if d["op"] == "call_function" else d["target"]  # (methods: by name)
            node = graph.create_node(d["op"], target, args, name=d["name"])
        assert node.name == d["name"], f"node {d['name']} came back as {node.name}"
        node.meta["val"] = tuple(
            torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for shape, dtype in d["tensors"]
        )
        made[d["name"]] = node
    return graph


_HIGHER_ORDER = "higher_order"  # torch.ops.higher_order: the namespace of higher-order operators


def _target_name(target) -> str:
    if isinstance(target, (torch._ops.OpOverload, str)):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):  # e.g. the rng state around a recomputed kernel on CUDA
        return f"{_HIGHER_ORDER}.{target.name()}"
    return f"{target.__module__}.{getattr(target, '__qualname__', type(target).__qualname__)}"


def _resolve(name: str):
    """The op or function `_target_name` named; an unknown one comes back as a stand-in function, which counts
    as a library kernel (as any Python callable that is not a view does)."""
    namespace, _, rest = name.partition(".")
    if namespace == _HIGHER_ORDER and hasattr(torch.ops.higher_order, rest):
        return getattr(torch.ops.higher_order, rest)
    if hasattr(torch.ops, namespace) and rest.count(".") == 1:
        op, overload = rest.split(".")
        try:
            return getattr(getattr(getattr(torch.ops, namespace), op), overload)
        except AttributeError:
            pass
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):

        def stand_in(*args):
            raise NotImplementedError(f"{name} is a stand-in: the graph was rebuilt for its shapes only")

        stand_in.__name__ = stand_in.__qualname__ = attr or name
        stand_in.__module__ = module  # (named as the original, so a rebuilt graph describes as it did)
        return stand_in
