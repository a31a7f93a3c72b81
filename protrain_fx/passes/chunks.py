"""Chunk passes: read parameters of offloaded chunks through gather/release, hand gradients to the chunks.

`chunk_tag_pass` decides (from the ChunkManager built for the plan) and writes `node.meta["protrain_param"]`
on each parameter placeholder; the two rewrite passes act on those tags only and leave a graph with no
tagged placeholder unchanged.

chunk_gather_pass (forward and backward graphs), for each offloaded chunk c:

    before:  w1 = placeholder; w2 = placeholder; ...; y = mm(x, w1); z = mm(y, w2)
    after:   buf = protrain.gather(m, c, [r_1, r_2, ...])  # after every release before it, whatever order
                                                  # the compiler picks (below)
             protrain.prefetch(m, c_next, buf)    # the chunk gathered next in this graph, on the copy stream
                                                  # (a forward's first: also right after its placeholders)
             w1' = view(slice(buf, 0, o1, o1 + n1), shape1); w2' = ...
             y = mm(x, w1'); z = mm(y, w2')
             r = protrain.release(m, c, [z])      # after the last reader of any parameter of c: it waits
                                                  # for the readers' outputs none of the others feeds (z, not y)

A chunk whose reads enclose the whole span of another chunk's reads is gathered once per run of its reads and
released between (`_runs`): a tied embedding, read at the forward's start and by the head at its end, holds a
buffer only while read, not across every block (each run reads views of its own gather, through copies of the
view chains, `_reroute`).

A gather has no data input but the tokens it is given, and inductor schedules a kernel as soon as its inputs
exist: without them it hoists gathers above the releases that free their buffers. So each gather takes the
tokens of every release placed before it (not the gather before it: a buffer may be its own input then, which
a custom op must not have): gathers run after the releases before them in the graph, the order
`_check_buffers` counts buffers in.

param_view_recompute_pass (joint graph, before partitioning): every view of an offloaded parameter (a
transpose, an expert's slice) is tagged for recomputation, so the partitioner saves the parameter, which the
backward gathers again, never a view of the chunk buffer the forward read it from (reused by then).

    before:  t = transpose(w); ...          # saved for backward: t (a view of w's buffer)
    after:   same, t tagged MUST_RECOMPUTE  # saved: w; the backward computes transpose(gather(...)) again

grad_reduce_pass (backward graph), for each chunk c (persistent ones too):

    before:  return (g1, g2, ...)                 # gradients of the primals, in primal order
    after:   protrain.reduce_grads(m, c, s, [i1, i2], [g1, g2], [r])   # after the chunk's last gradient and
                                                                        # the outputs r of its last readers; s:
                                                                        # this frame (runtime/chunks/arrivals.py)
             return (None, None, ...)             # the chunk owns its gradients; param.grad stays None

A chunk's update may start at its reduce, during the backward: the readers r are an offloaded chunk's (its
release's) and those of a persistent chunk whose parameters are their own master (`own_master`), which that
update changes in place; none for other persistent chunks, whose update changes only their master copy.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

import networkx as nx
import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.capture import is_backward
from protrain_fx.passes.contract import BACKWARD, FORWARD, JOINT, RECOMPUTE, PassContext, graph_pass
from protrain_fx.passes.views import is_view, view_base

TAG = "protrain_param"
RELEASES = "protrain.release"  # the tag of the release ops chunk_gather_pass places, where grad_reduce_pass reduces


@dataclasses.dataclass(frozen=True)
class ParamTag:
    manager: int  # handle of the ChunkManager (runtime/ops.py)
    index: int  # the parameter's index in the manager
    chunk: int
    offset: int
    numel: int
    persistent: bool
    # the parameter is its chunk's master (runtime/chunks/): a persistent chunk's update during the backward
    # changes it, so the chunk's reduce, where that update starts, comes after the backward's reads of it
    own_master: bool = False


@graph_pass(graphs=(JOINT,), requires=("manager", "record", "example_inputs"), provides=(RECOMPUTE,))
def param_view_recompute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Tag the forward's views of offloaded parameters for recomputation (see the module docstring)."""
    manager = ctx.manager
    if manager is None:
        return gm
    todo = []
    for node in gm.graph.find_nodes(op="placeholder"):
        entry = ctx.record.param_map.get(node.name)
        param = ctx.example_inputs[entry.index] if entry is not None else None
        if param is not None and manager.holds(param) and not manager.is_persistent(param):
            todo.extend(node.users)
    while todo:
        node = todo.pop()
        if is_view(node) and not is_backward(node):
            node.meta.setdefault("recompute", CheckpointPolicy.MUST_RECOMPUTE)
            todo.extend(node.users)
    return gm


@graph_pass(graphs=(FORWARD, BACKWARD), requires=("manager", "record", "example_inputs"), provides=(TAG,))
def chunk_tag_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Tag the parameter placeholders of a forward or backward graph with their chunk (names are AOT primal names)."""
    manager = ctx.manager
    if manager is None:
        return gm
    for node in gm.graph.nodes:
        entry = ctx.record.param_map.get(node.name) if node.op == "placeholder" else None
        param = ctx.example_inputs[entry.index] if entry is not None else None
        if param is None or not manager.holds(param):  # (a frozen parameter, say: a plain input)
            continue
        slot = manager.slot_of(param)
        node.meta[TAG] = ParamTag(
            manager=manager.handle,
            index=manager.index[id(param)],
            chunk=slot.chunk,
            offset=slot.offset,
            numel=slot.numel,
            persistent=manager.is_persistent(param),
            own_master=manager.own_master,
        )
    return gm


def _readers(placeholders: list[fx.Node]) -> list[fx.Node]:
    """Nodes computing with the parameters (the output node only passes a saved parameter on)."""
    return [u for p in placeholders for u in p.users if u.op != "output"]


def _data_readers(node: fx.Node, *, returned_ok: bool = False) -> list[fx.Node]:
    """The nodes that read `node`'s data: its users, seen through view ops (a view reads nothing; what consumes
    the view does). A view of a chunk buffer must not leave the graph, since the buffer is reused (`returned_ok`:
    a graph not rewritten yet, which may return one: left out)."""
    readers, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if user.op == "output" and returned_ok:
            continue
        assert user.op != "output", f"{node.name}: a view of a chunk buffer is returned by the graph"
        if is_view(user):
            todo.extend(user.users)
        else:
            readers.append(user)
    return readers


def _tensor_outputs(nodes: list[fx.Node]) -> list[fx.Node]:
    """The tensors these nodes produce (a tuple-valued node through its getitem users): release's inputs."""
    out = []
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            out.append(n)
        elif isinstance(val, (tuple, list)):
            out.extend(u for u in n.users if isinstance(u.meta.get("val"), torch.Tensor))
    return out


def _downstream(outputs: list[fx.Node], dag: nx.DiGraph, order: dict[fx.Node, int]) -> list[fx.Node]:
    """The outputs no other of them is computed from: waiting for these waits for all, and the others are
    not held alive until the release (a recomputed block's activations would stay to the end of the chunk)."""
    kept: list[fx.Node] = []
    covered: set[fx.Node] = set()
    for n in sorted(outputs, key=order.__getitem__, reverse=True):  # an ancestor comes before what it feeds
        if n not in covered:
            kept.append(n)
            covered |= nx.ancestors(dag, n)
    return sorted(kept, key=order.__getitem__)


@graph_pass(graphs=(FORWARD, BACKWARD), requires=("manager",), requires_tags=(TAG,), provides=(RELEASES,))
def chunk_gather_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Route every read of an offloaded parameter through its chunk's gather (see the module docstring)."""
    graph = gm.graph
    by_chunk: dict[int, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        tag = node.meta.get(TAG)
        if node.op == "placeholder" and tag is not None and not tag.persistent and node.users:
            by_chunk[tag.chunk].append(node)
    if not by_chunk:
        return gm
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_chunk = {c: phs for c, phs in by_chunk.items() if _readers(phs)}
    runs = _runs({c: [r for ph in phs for r in _param_readers(ph)] for c, phs in by_chunk.items()}, order)
    readers_of: list[tuple[int, list[fx.Node]]] = []  # (chunk, the readers of one gather), gather by gather
    for chunk, placeholders in sorted(by_chunk.items(), key=lambda kv: min(map(order.__getitem__, _readers(kv[1])))):
        tag = placeholders[0].meta[TAG]
        if len(runs[chunk]) > 1:
            readers_of += [(chunk, run) for run in _gather_per_run(graph, tag, placeholders, runs[chunk])]
            continue
        first = min(_readers(placeholders), key=order.__getitem__)
        with graph.inserting_before(first):
            buf = graph.call_function(torch.ops.protrain.gather.default, (tag.manager, chunk, []))
            readers = []
            for ph in placeholders:
                view = _param_view(graph, buf, ph)
                # the graph's output keeps the placeholder: a forward that saves a parameter for backward
                # hands over the parameter itself, and the backward gathers it again
                ph.replace_all_uses_with(view, delete_user_cb=lambda u: u.op != "output")
                readers.extend(_data_readers(view))
        readers_of.append((chunk, readers))
    gathers = [n for n in graph.nodes if n.target is torch.ops.protrain.gather.default]
    for gather, following in zip(gathers, gathers[1:]):
        with graph.inserting_after(gather):
            graph.call_function(torch.ops.protrain.prefetch.default, (following.args[0], following.args[1], gather))
    _prefetch_first(graph, gathers[0], ctx)
    order = {n: i for i, n in enumerate(graph.nodes)}
    dag = nx.DiGraph((a, n) for n in graph.nodes for a in n.all_input_nodes)
    for chunk, readers in readers_of:
        outputs = _tensor_outputs(readers)
        deps = _downstream(outputs, dag, order)
        last = max(readers + deps, key=order.__getitem__)
        tag = by_chunk[chunk][0].meta[TAG]
        with graph.inserting_after(last):
            graph.call_function(torch.ops.protrain.release.default, (tag.manager, chunk, deps))
        _materialize_escaping(graph, [o for o in outputs if o not in deps], set(readers))
    _order_gathers(graph)
    _check_buffers(graph, ctx)
    graph.lint()
    gm.recompile()
    return gm


def _param_view(graph: fx.Graph, buf: fx.Node, placeholder: fx.Node) -> fx.Node:
    """The parameter `placeholder` as a view of its chunk's gathered buffer `buf` (inserted at the graph's
    insertion point)."""
    t = placeholder.meta[TAG]
    piece = graph.call_function(torch.ops.aten.slice.Tensor, (buf, 0, t.offset, t.offset + t.numel))
    view = graph.call_function(torch.ops.aten.view.default, (piece, list(placeholder.meta["val"].shape)))
    view.meta["val"] = placeholder.meta.get("val")
    return view


def _param_readers(placeholder: fx.Node, *, returned_ok: bool = False) -> list[fx.Node]:
    """The nodes that read a parameter's data, seen through views (the output only passes the parameter on)."""
    users = [u for u in placeholder.users if u.op != "output"]
    return [r for u in users for r in (_data_readers(u, returned_ok=returned_ok) if is_view(u) else [u])]


def _runs(
    readers: dict[int, list[fx.Node]], order: dict[fx.Node, int], offloaded_from: int = 0
) -> dict[int, list[list[fx.Node]]]:
    """Each chunk's readers in graph order, cut into runs where the whole span of another chunk's readers lies
    between two of them: the chunk is released and gathered again around it, so it holds no buffer meanwhile
    (a tied embedding, read at the start of the forward and by its head at the end; T5's shared embedding, read by
    the encoder, the decoder and the head). Chunks whose reads overlap or touch stay in one run. Only the spans of
    chunks `offloaded_from` and later cut (the others are persistent: never gathered)."""
    runs: dict[int, list[list[fx.Node]]] = {}
    for chunk, (rs, inner) in _gaps(readers, order).items():
        runs[chunk] = [[rs[0]]]
        for after, cut_by in zip(rs[1:], inner):
            if cut_by >= offloaded_from:
                runs[chunk].append([])
            runs[chunk][-1].append(after)
    return runs


def _gaps(readers: dict[int, list[fx.Node]], order: dict[fx.Node, int]) -> dict[int, tuple[list[fx.Node], list[int]]]:
    """Each chunk's readers in graph order, and for each gap between two of them the last chunk whose whole span
    of readers lies inside it (-1: none), which cuts the chunk's reads there where it is offloaded (`_runs`)."""
    spans = {c: (min(map(order.__getitem__, rs)), max(map(order.__getitem__, rs))) for c, rs in readers.items()}
    gaps = {}
    for chunk, rs in readers.items():
        rs = sorted(set(rs), key=order.__getitem__)
        inner = [
            max((c for c, (a, b) in spans.items() if c != chunk and order[before] < a and b < order[after]), default=-1)
            for before, after in zip(rs, rs[1:])
        ]
        gaps[chunk] = (rs, inner)
    return gaps


def buffers_needed(gm: fx.GraphModule, chunk_of: dict[str, int], n_chunk: int) -> list[int]:
    """For each n_persist in 0..n_chunk: the most chunks `gm` holds at once where the chunks from n_persist on are
    offloaded, as chunk_gather_pass gathers and releases them (a run of reads each, `_runs`) and `_check_buffers`
    counts them: the fewest chunk buffers it runs with (more than two where a layer's weights are read again while
    others are held: weights shared by several layers, a model's own activation checkpointing). `chunk_of`:
    parameter placeholder name -> its chunk."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placeholders: dict[int, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.name in chunk_of:
            placeholders[chunk_of[node.name]].append(node)
    # (a forward as first partitioned may save a view of a parameter for the backward, which the rewrite recomputes
    # there from the parameter: its reads in the backward are not counted)
    reads = {c: [r for ph in phs for r in _param_readers(ph, returned_ok=True)] for c, phs in placeholders.items()}
    readers = {c: rs for c, rs in reads.items() if rs}
    gaps = _gaps(readers, order)
    # a chunk read in one run is gathered before its parameters' first user, a view included
    first_user = {c: min(order[u] for u in _readers(placeholders[c])) for c in readers}
    needed = []
    for n_persist in range(n_chunk + 1):
        spans = []
        for chunk, (rs, inner) in gaps.items():
            if chunk >= n_persist:
                spans += _run_spans(rs, inner, n_persist, order, first_user[chunk])
        needed.append(_most_at_once(spans))
    return needed


def _run_spans(rs: list[fx.Node], inner: list[int], offloaded_from: int, order: dict[fx.Node, int], first_user: int):
    """(gather, release) graph positions of each run of a chunk's reads (`_gaps`' readers and gaps): from before
    its first reader (one run: its first user) to after its readers' outputs (`_tensor_outputs`)."""
    cuts = [0, *(k + 1 for k, cut_by in enumerate(inner) if cut_by >= offloaded_from), len(rs)]
    spans = [(order[rs[a]], max(order[n] for n in rs[a:b] + _tensor_outputs(rs[a:b]))) for a, b in zip(cuts, cuts[1:])]
    return [(first_user, spans[0][1])] if len(spans) == 1 else spans


def _most_at_once(spans: list[tuple[int, int]]) -> int:
    """The most spans (closed intervals) any one of them starts inside."""
    events = sorted([(a, 0) for a, _ in spans] + [(b, 1) for _, b in spans])  # (a start before an end at one place)
    most = held = 0
    for _, end in events:
        held += -1 if end else 1
        most = max(most, held)
    return most


def _gather_per_run(graph: fx.Graph, tag: ParamTag, placeholders: list[fx.Node], runs: list[list[fx.Node]]):
    """Gather the chunk before each run of its reads (`_runs`): the run's readers read views of that gather's
    buffer, through copies of the view chains between the parameter and them (one per run). Returns the runs."""
    run_of = {r: k for k, run in enumerate(runs) for r in run}
    stand_ins: dict[fx.Node, dict[int, fx.Node]] = {ph: {} for ph in placeholders}
    for k, run in enumerate(runs):
        with graph.inserting_before(run[0]):
            buf = graph.call_function(torch.ops.protrain.gather.default, (tag.manager, tag.chunk, []))
            for ph in placeholders:
                if any(run_of[r] == k for r in _param_readers(ph)):
                    stand_ins[ph][k] = _param_view(graph, buf, ph)
    for ph in placeholders:
        _reroute(graph, ph, stand_ins[ph], run_of)
    return runs


def _reroute(graph: fx.Graph, node: fx.Node, stand_ins: dict[int, fx.Node], run_of: dict[fx.Node, int]) -> None:
    """Each user of `node` (a parameter, or a view of one) reads the stand-in of its run instead: a reader
    directly, a view through a copy of it per run it serves, made right after that run's stand-in (the view
    itself is erased)."""
    for user in list(node.users):
        if user.op == "output":
            continue
        if not is_view(user):
            user.replace_input_with(node, stand_ins[run_of[user]])
            continue
        copies = {}
        for k in sorted({run_of[r] for r in _data_readers(user)}):
            with graph.inserting_after(stand_ins[k]):
                copies[k] = graph.node_copy(user, _reading(node, stand_ins[k]))
        _reroute(graph, user, copies, run_of)
        graph.erase_node(user)


def _reading(node: fx.Node, stand_in: fx.Node) -> Callable[[fx.Node], fx.Node]:
    """`Graph.node_copy`'s map of a copy's inputs: `stand_in` in place of `node`, the others as they are."""
    return lambda a: stand_in if a is node else a


def _prefetch_first(graph: fx.Graph, first: fx.Node, ctx: PassContext) -> None:
    """A forward starts loading the first chunk it gathers as it starts (`prefetch` loads it if its host update
    is done, as it mostly is by then), not once the CPU reaches the gather, after launching every persistent
    chunk's kernels: the chunk's copy runs beside their compute then, as planner/timeline.py lays it out. (A
    backward's first chunk is mostly still in its buffer from the forward.)"""
    if ctx.stage == "backward":
        return
    placeholders = list(graph.find_nodes(op="placeholder"))
    inputs = [
        n
        for n in placeholders
        if isinstance(n.meta.get("val"), torch.Tensor) and (TAG not in n.meta or n.meta[TAG].persistent)
    ]
    if not inputs:
        return
    with graph.inserting_after(placeholders[-1]):
        graph.call_function(torch.ops.protrain.prefetch.default, (first.args[0], first.args[1], inputs[0]))


def _materialize_escaping(graph: fx.Graph, outputs: list[fx.Node], readers: set[fx.Node]) -> None:
    """Reader outputs the release does not wait for but a node other than a reader uses (a residual stream
    `x = embed + pos`, read again by a later block) get `protrain.materialize` right after them: inductor
    computes an op's inputs into buffers, where it would otherwise recompute such a pointwise reader inside
    the later kernel, reading the chunk buffer after the release, when the next gather may have loaded
    another chunk into it. The release waits for the others (module docstring); these are not held to it."""
    for out in outputs:
        if any(u not in readers and u.target is not torch.ops.protrain.release.default for u in out.users):
            with graph.inserting_after(out):
                graph.call_function(torch.ops.protrain.materialize.default, ([out],))


def _order_gathers(graph: fx.Graph) -> None:
    """Each gather waits for every release before it (see the module docstring)."""
    released: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.target is torch.ops.protrain.release.default:
            released.append(node)
        elif node.target is torch.ops.protrain.gather.default:
            node.args = (*node.args[:2], list(released))


def _check_buffers(graph: fx.Graph, ctx: PassContext) -> None:
    """A plan with fewer chunk buffers than the graph holds chunks at once cannot run: say so at compile time."""
    live: set[int] = set()
    worst: tuple[int, str, list[int]] = (0, "", [])
    for node in graph.nodes:
        if node.target is torch.ops.protrain.gather.default:
            live.add(node.args[1])
            if len(live) > worst[0]:
                worst = (len(live), node.name, sorted(live))
        elif node.target is torch.ops.protrain.release.default:
            live.discard(node.args[1])
    assert ctx.manager is not None, f"the {ctx.stage} graph gathers chunks {worst[2]} with no chunk manager"
    if worst[0] > ctx.manager.n_buffer:
        raise ValueError(
            f"the plan has n_buffer={ctx.manager.n_buffer} chunk buffers, but the {ctx.stage} graph uses chunks "
            f"{worst[2]} at once (at {worst[1]}); force n_buffer={worst[0]} or more (in options['plan'], or in "
            f"protrain_fx.prepare's plan for a prepared model), or leave n_buffer to the search"
        )


@graph_pass(
    graphs=(BACKWARD,),
    requires=("forward_placeholders", "forward_outputs", "grad_source"),
    requires_tags=(TAG, RELEASES),
    requires_forward_tags=(TAG,),
)
def grad_reduce_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Hand each chunk's gradients to the ChunkManager and return None for them (see the module docstring)."""
    graph = gm.graph
    if ctx.stage != "backward" or not any(TAG in p.meta for p in ctx.forward_placeholders):
        return gm
    output = next(n for n in graph.nodes if n.op == "output")
    grads = list(output.args[0])
    # the backward returns one gradient per primal; the partitioner may add other forward inputs after them
    # (the RNG states of recomputed random ops on CUDA), which get none
    primals = [n for n in ctx.forward_placeholders if n.name.startswith("primals")]
    assert len(grads) == len(primals), f"backward returns {len(grads)} gradients for {len(primals)} primals"
    by_chunk: dict[int, list[tuple[int, int, fx.Node]]] = defaultdict(list)
    for position, (primal, grad) in enumerate(zip(primals, grads)):
        tag = primal.meta.get(TAG)
        if tag is not None and isinstance(grad, fx.Node):
            by_chunk[tag.chunk].append((position, tag.index, grad))
    if not by_chunk:
        return gm
    order = {n: i for i, n in enumerate(graph.nodes)}
    # the chunk's last readers too, where its update starts at the reduce and changes what they read: an
    # offloaded chunk's (its release waits for them), a persistent one's that is its own master
    readers_of: dict[int, tuple[list[fx.Node], list[fx.Node]]] = {
        n.args[1]: (list(n.args[2]), [n])
        for n in graph.find_nodes(op="call_function", target=torch.ops.protrain.release.default)
    }
    readers_of.update(_own_master_readers(graph, order, _saved_param_views(ctx.forward_outputs)))
    for chunk, items in by_chunk.items():
        readers, after = readers_of.get(chunk, ([], []))
        last = max([*(g for _, _, g in items), *after], key=order.__getitem__)
        manager = primals[items[0][0]].meta[TAG].manager
        with graph.inserting_after(last):
            graph.call_function(
                torch.ops.protrain.reduce_grads.default,
                (manager, chunk, ctx.grad_source, [i for _, i, _ in items], [g for _, _, g in items], readers),
            )
        for position, _, _ in items:
            grads[position] = None
    output.args = (tuple(grads),)
    graph.lint()
    gm.recompile()
    return gm


def _saved_param_views(forward_outputs) -> dict[str, int]:
    """Name of a tensor the forward saves for the backward that is a view of a persistent parameter that is its
    own master (the partitioner mostly saves the parameter itself, which is tagged) -> its chunk."""
    views = {}
    for out in forward_outputs:
        base = view_base(out)
        tag = base.meta.get(TAG) if base is not out and base.op == "placeholder" else None
        if tag is not None and tag.persistent and tag.own_master:
            views[out.name] = tag.chunk
    return views


def _own_master_readers(
    graph: fx.Graph, order: dict[fx.Node, int], saved_views: dict[str, int]
) -> dict[int, tuple[list[fx.Node], list[fx.Node]]]:
    """Persistent chunk whose parameters are their own master -> (the outputs of the last readers of its
    parameters in this graph, as a release takes them; every reader and those outputs). The parameters come in
    as tagged placeholders, or as views the forward saved (`saved_views`, by name)."""
    reads: dict[int, list[fx.Node]] = defaultdict(list)
    for node in graph.find_nodes(op="placeholder"):
        tag = node.meta.get(TAG)
        if tag is not None and tag.persistent and tag.own_master:
            reads[tag.chunk].extend(_data_readers(node))
        elif node.name in saved_views:
            reads[saved_views[node.name]].extend(_data_readers(node))
    if not reads:
        return {}
    dag = nx.DiGraph((a, n) for n in graph.nodes for a in n.all_input_nodes)
    out = {}
    for chunk, readers in reads.items():
        deps = _downstream(_tensor_outputs(readers), dag, order)
        out[chunk] = (deps, readers + deps)
    return out
