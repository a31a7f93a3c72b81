"""The chunk passes alone, on a small graph: they rewrite what is tagged, leave an untagged graph unchanged,
and the rewritten graph computes the same values."""

import copy
import types

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from protrain_fx.passes.chunks import TAG, ParamTag, buffers_needed, chunk_gather_pass, grad_reduce_pass
from protrain_fx.planner.chunking import ParamInfo, layout_at
from protrain_fx.runtime.chunks import ChunkManager


def two_layers(w1, w2, x):
    return torch.relu(x @ w1.t()) @ w2.t()


def setup():
    torch.manual_seed(0)
    w1, w2 = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(3, 8))
    x = torch.randn(5, 4)
    expected = two_layers(w1, w2, x).detach()
    gm = make_fx(two_layers)(w1.detach(), w2.detach(), x)
    return w1, w2, x, expected, gm


def test_untagged_graph_unchanged():
    *_, gm = setup()
    before = gm.code
    ctx = types.SimpleNamespace(manager=None, stage="forward", forward_placeholders=[])
    assert chunk_gather_pass(gm, ctx).code == before
    ctx = types.SimpleNamespace(stage="backward", forward_placeholders=[], forward_outputs=[])
    assert grad_reduce_pass(gm, ctx).code == before


def tagged(stage: str):
    """The two layers' graph with both parameters in one offloaded chunk, through chunk_gather_pass at `stage`."""
    w1, w2, x, expected, gm = setup()
    layout = layout_at(
        [ParamInfo("w1", 32, None), ParamInfo("w2", 24, None)], chunk_elems=64, element_size=4, world_size=1
    )
    manager = ChunkManager([w1, w2], layout, n_persist=0, n_buffer=1)  # one chunk, offloaded: storages emptied
    assert w1.untyped_storage().nbytes() == 0
    for node, param in zip([n for n in gm.graph.nodes if n.op == "placeholder"], [w1, w2]):
        slot = manager.slot_of(param)
        node.meta[TAG] = ParamTag(manager.handle, manager.index[id(param)], slot.chunk, slot.offset, slot.numel, False)
    return w1, w2, x, expected, chunk_gather_pass(gm, types.SimpleNamespace(manager=manager, stage=stage))


def test_tagged_graph_gathers_and_computes_the_same():
    w1, w2, x, expected, gm = tagged("forward")
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.protrain.gather.default) == 1
    assert targets.count(torch.ops.protrain.release.default) == 1
    assert targets.index(torch.ops.protrain.gather.default) < targets.index(torch.ops.aten.t.default)
    # released after the last reader of the chunk's parameters (the second matmul)
    assert targets.index(torch.ops.protrain.release.default) > max(
        i for i, t in enumerate(targets) if t is torch.ops.aten.mm.default
    )
    # it waits for the second matmul's output only: the first's feeds it, and is not held until the release
    release = next(n for n in gm.graph.nodes if n.target is torch.ops.protrain.release.default)
    assert [n.target for n in release.args[2]] == [torch.ops.aten.mm.default]
    assert release.args[2][0] is max(
        gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default), key=list(gm.graph.nodes).index
    )
    # a forward starts loading its first offloaded chunk as it starts, ordered after an input (x), not a parameter
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert first.target is torch.ops.protrain.prefetch.default and first.args[1] == 0
    assert first.args[2] is list(gm.graph.find_nodes(op="placeholder"))[-1]
    torch.testing.assert_close(gm(w1, w2, x), expected, rtol=0, atol=0)
    # a backward's first chunk is mostly still in its buffer from the forward: nothing loads it early
    *_, backward = tagged("backward")
    assert not backward.graph.find_nodes(op="call_function", target=torch.ops.protrain.prefetch.default)


def test_a_chunk_read_again_after_another_is_gathered_again():
    """`e` (chunk 0) is read at the start and, through a view made at the start, at the end; `w` (chunk 1) in
    between: chunk 0 is released before chunk 1 is gathered and gathered again after, so one buffer does. Each run
    reads its own copy of the view chain, and the values are the same."""

    def tied(e, w, x):
        et = e.t()  # one view, read at the start and (through another view) at the end
        h = torch.relu(torch.relu(x @ et) @ w.t())
        return h @ et.t()

    torch.manual_seed(0)
    e, w, x = nn.Parameter(torch.randn(4, 8)), nn.Parameter(torch.randn(4, 4)), torch.randn(5, 8)
    expected = tied(e, w, x).detach()
    gm = make_fx(tied)(e.detach(), w.detach(), x)
    layout = layout_at([ParamInfo("e", 32, None, alone=True), ParamInfo("w", 16, None)], 64, 4, 1)
    manager = ChunkManager([e, w], layout, n_persist=0, n_buffer=1)
    for node, param in zip([n for n in gm.graph.nodes if n.op == "placeholder"], [e, w]):
        slot = manager.slot_of(param)
        node.meta[TAG] = ParamTag(manager.handle, manager.index[id(param)], slot.chunk, slot.offset, slot.numel, False)
    gm = chunk_gather_pass(gm, types.SimpleNamespace(manager=manager, stage="forward"))
    ops = {torch.ops.protrain.gather.default: "gather", torch.ops.protrain.release.default: "release"}
    sequence = [(ops[n.target], n.args[1]) for n in gm.graph.nodes if n.target in ops]
    assert sequence == [("gather", 0), ("release", 0), ("gather", 1), ("release", 1), ("gather", 0), ("release", 0)]
    assert all(not n.users for n in gm.graph.find_nodes(op="placeholder")[:2])  # every read goes through a gather
    torch.testing.assert_close(gm(e, w, x), expected, rtol=0, atol=0)


def test_grad_reduce_pass_hands_gradients_over():
    """A backward graph returning gradients of two tagged primals: they go to reduce_grads, the output gets None."""
    w1, w2, x, _, _ = setup()
    layout = layout_at(
        [ParamInfo("w1", 32, None), ParamInfo("w2", 24, None)], chunk_elems=64, element_size=4, world_size=1
    )
    manager = ChunkManager([w1, w2], layout, n_persist=1, n_buffer=0)  # persistent: gradients land on the device

    def backward(g1, g2):
        return (g1 * 2, g2 * 2)

    bw = make_fx(backward)(torch.ones(8, 4), torch.ones(3, 8))
    forward_placeholders = [
        types.SimpleNamespace(
            name=f"primals_{i + 1}", meta={TAG: ParamTag(manager.handle, i, 0, s.offset, s.numel, True)}
        )
        for i, s in enumerate(manager.slots)
    ]
    ctx = types.SimpleNamespace(
        manager=manager, stage="backward", forward_placeholders=forward_placeholders, forward_outputs=[], grad_source=0
    )
    bw = grad_reduce_pass(bw, ctx)
    assert bw(torch.ones(8, 4), torch.ones(3, 8)) == (None, None)
    assert torch.equal(manager.storage.grad[0][:32], torch.full((32,), 2.0)) and torch.equal(
        manager.storage.grad[0][32:56], torch.full((24,), 2.0)
    )


def reduced(bw, tag: ParamTag, forward_outputs=()):
    """A backward returning (gradient of w, gradient of x) of a forward of (w, x), w tagged `tag`, through
    grad_reduce_pass: the graph, its nodes and its reduce_grads node."""
    primals = [
        types.SimpleNamespace(name="primals_1", meta={TAG: tag}),
        types.SimpleNamespace(name="primals_2", meta={}),
    ]
    ctx = types.SimpleNamespace(
        stage="backward", forward_placeholders=primals, forward_outputs=list(forward_outputs), grad_source=0
    )
    bw = grad_reduce_pass(bw, ctx)
    nodes = list(bw.graph.nodes)
    return bw, nodes, next(n for n in nodes if n.target is torch.ops.protrain.reduce_grads.default)


def test_offloaded_reduce_waits_for_the_last_read():
    """A weight's gradient can be ready before the backward's last read of the weight (gw = gy^T x needs no w,
    gx = gy w does): an offloaded chunk's reduce, where its CPU update starts, must come after that read too,
    ordered by data (the readers' outputs are its arguments), not only by its place in the graph."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    w_value = w.detach().clone()
    layout = layout_at([ParamInfo("w", 12, None)], chunk_elems=64, element_size=4, world_size=1)
    manager = ChunkManager([w], layout, n_persist=0, n_buffer=1)  # offloaded: w's storage is emptied

    def backward(w, x, gy):
        return gy.t() @ x, gy @ w  # (gradient of w, gradient of x)

    x, gy = torch.randn(5, 4), torch.randn(5, 3)
    bw = make_fx(backward)(w_value, x, gy)
    slot = manager.slot_of(w)
    tag = ParamTag(manager.handle, 0, slot.chunk, slot.offset, slot.numel, False)
    next(n for n in bw.graph.nodes if n.op == "placeholder").meta[TAG] = tag
    bw = chunk_gather_pass(bw, types.SimpleNamespace(manager=manager, stage="backward"))
    bw, nodes, reduce = reduced(bw, tag)
    release = next(n for n in nodes if n.target is torch.ops.protrain.release.default)
    assert nodes.index(reduce) > nodes.index(release) and reduce.args[5] == release.args[2]
    _, grad_x = bw(w, x, gy)
    torch.testing.assert_close(grad_x, gy @ w_value, rtol=0, atol=0)


def test_own_master_reduce_waits_for_the_last_read():
    """A persistent chunk whose parameters are their own master (a float32 model, or bfloat16 masters) updates
    them in place at its reduce: like an offloaded chunk's, that reduce comes after the backward's last read of
    them, ordered by data. A persistent chunk with a separate master reduces right after its last gradient."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    w_value = w.detach().clone()
    layout = layout_at([ParamInfo("w", 12, None)], chunk_elems=64, element_size=4, world_size=1)
    manager = ChunkManager([w], layout, n_persist=1, n_buffer=0)  # float32: the parameter is its own master
    assert manager.own_master

    def backward(w, x, gy):
        return gy.t() @ x, gy @ w  # (gradient of w, gradient of x): w is read after its gradient is ready

    x, gy = torch.randn(5, 4), torch.randn(5, 3)
    slot = manager.slot_of(w)
    for own_master in (True, False):
        bw = make_fx(backward)(w_value, x, gy)
        tag = ParamTag(manager.handle, 0, slot.chunk, slot.offset, slot.numel, True, own_master)
        next(n for n in bw.graph.nodes if n.op == "placeholder").meta[TAG] = tag
        bw, nodes, reduce = reduced(bw, tag)
        grad_w, read = [n for n in nodes if n.target is torch.ops.aten.mm.default]
        if own_master:
            assert nodes.index(reduce) > nodes.index(read) and reduce.args[5] == [read], bw.code
        else:
            assert nodes.index(reduce) == nodes.index(grad_w) + 1 and reduce.args[5] == [], bw.code
        _, grad_x = bw(w, x, gy)
        torch.testing.assert_close(grad_x, gy @ w_value, rtol=0, atol=0)


def test_own_master_reduce_waits_for_reads_of_a_saved_view():
    """Where the forward saves a view of such a parameter (w.t()) rather than the parameter, the backward reads
    the parameter through that view: its reduce still comes after the read."""
    w = nn.Parameter(torch.randn(3, 4))
    layout = layout_at([ParamInfo("w", 12, None)], chunk_elems=64, element_size=4, world_size=1)
    manager = ChunkManager([w], layout, n_persist=1, n_buffer=0)
    slot = manager.slot_of(w)
    tag = ParamTag(manager.handle, 0, slot.chunk, slot.offset, slot.numel, True, True)
    x, gy = torch.randn(5, 4), torch.randn(5, 3)
    fw = make_fx(lambda w, x: (x @ w.t(), w.t()))(w.detach(), x)
    next(n for n in fw.graph.nodes if n.op == "placeholder").meta[TAG] = tag
    saved = next(n for n in fw.graph.nodes if n.op == "output").args[0][1]  # the view w.t() the backward gets
    bw = make_fx(lambda wt, x, gy: (gy.t() @ x, gy @ wt.t()))(w.detach().t(), x, gy)
    placeholder = next(n for n in bw.graph.nodes if n.op == "placeholder")
    for node in (saved, placeholder):  # (AOTAutograd names the two alike)
        node._rename("saved_view")
    assert saved.name == placeholder.name == "saved_view"
    bw, nodes, reduce = reduced(bw, tag, [saved])
    read = [n for n in nodes if n.target is torch.ops.aten.mm.default][1]
    assert nodes.index(reduce) > nodes.index(read) and reduce.args[5] == [read], bw.code
    bw, nodes, reduce = reduced(make_fx(lambda wt, x, gy: (gy.t() @ x, gy @ wt.t()))(w.detach().t(), x, gy), tag)
    assert reduce.args[5] == [], bw.code  # (no saved view named: nothing to wait for)


def test_release_waits_for_the_reads_of_split_pieces():
    """A parameter split into pieces (`split` gives views, each taken by a getitem) is read where the pieces
    are: the release comes after those reads, not after the getitems."""
    w = nn.Parameter(torch.randn(8, 4))
    x = torch.randn(5, 4)

    def pieces(w, x):
        a, b = w.split(4)
        return torch.relu(x @ a.t()) + x @ b.t()

    gm = make_fx(pieces)(w.detach(), x)
    layout = layout_at([ParamInfo("w", 32, None)], chunk_elems=64, element_size=4, world_size=1)
    manager = ChunkManager([w], layout, n_persist=0, n_buffer=1)  # offloaded: w's storage is emptied
    slot = manager.slot_of(w)
    next(n for n in gm.graph.nodes if n.op == "placeholder").meta[TAG] = ParamTag(
        manager.handle, 0, slot.chunk, slot.offset, slot.numel, False
    )
    gm = chunk_gather_pass(gm, types.SimpleNamespace(manager=manager, stage="forward"))
    nodes = list(gm.graph.nodes)
    release = next(n for n in nodes if n.target is torch.ops.protrain.release.default)
    matmuls = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    assert len(matmuls) == 2 and nodes.index(release) > max(map(nodes.index, matmuls)), gm.code


def _shared_layer(e, w1, w2, w3, x):
    """An embedding `e` read at the start and the end around a layer of three weights applied twice (weights
    shared by both applications, as ALBERT's layers share theirs)."""
    h = x @ e.t()
    for _ in range(2):
        h = torch.relu(torch.relu(h @ w1.t()) @ w2.t()) @ w3.t()
    return h @ e


@pytest.mark.parametrize("n_persist", range(4))
def test_buffers_needed_are_what_the_gather_pass_holds(n_persist):
    """`buffers_needed` says, for each n_persist, how many chunk buffers chunk_gather_pass's graph holds at once
    (a chunk each parameter): the layer's three chunks while both applications read them (two once the first is
    persistent), the embedding gathered again after them. With that many buffers the pass rewrites the graph, with
    one fewer it refuses it."""
    torch.manual_seed(0)
    shapes = {"e": (8, 4), "w1": (8, 8), "w2": (8, 8), "w3": (8, 8)}
    x = torch.randn(5, 4)
    gm = make_fx(_shared_layer)(*(torch.randn(s) for s in shapes.values()), x)
    needed = buffers_needed(gm, {f"{name}_1": i for i, name in enumerate(shapes)}, n_chunk=4)
    assert needed == [3, 3, 2, 1, 0]
    for n_buffer in [n for n in (needed[n_persist], needed[n_persist] - 1) if n > 0]:
        graph, ctx = _tagged_copy(gm, shapes, n_persist, n_buffer)
        if n_buffer == needed[n_persist]:
            chunk_gather_pass(graph, ctx)
        else:
            with pytest.raises(
                ValueError, match=f"uses chunks .* at once .*force n_buffer={needed[n_persist]} or more"
            ):
                chunk_gather_pass(graph, ctx)


def _tagged_copy(gm, shapes: dict, n_persist: int, n_buffer: int):
    """A copy of `gm` whose placeholders are parameters of `shapes`, each alone in a chunk of a manager of
    `n_persist` persistent chunks and `n_buffer` buffers, tagged; and the pass context."""
    params = [nn.Parameter(torch.randn(s)) for s in shapes.values()]
    infos = [ParamInfo(name, p.numel(), None, alone=True) for name, p in zip(shapes, params)]
    manager = ChunkManager(params, layout_at(infos, 64, 4, 1), n_persist=n_persist, n_buffer=n_buffer)
    graph = copy.deepcopy(gm)
    for node, p in zip(graph.graph.find_nodes(op="placeholder"), params):
        slot = manager.slot_of(p)
        persistent = manager.is_persistent(p)
        node.meta[TAG] = ParamTag(manager.handle, manager.index[id(p)], slot.chunk, slot.offset, slot.numel, persistent)
    return graph, types.SimpleNamespace(manager=manager, stage="forward")


def test_buffers_needed_of_a_forward_saving_a_view_of_a_parameter():
    """A forward as first partitioned may return a view of a parameter (saved for the backward, which the rewrite
    recomputes from the parameter): `buffers_needed` counts the other reads and leaves the view out (one chunk at
    a time: `w` is released after its matmul, before `v` is gathered)."""

    def saving(w, v, x):
        return (x @ w.t()) @ v.t(), w.t()

    gm = make_fx(saving)(torch.randn(4, 4), torch.randn(4, 4), torch.randn(2, 4))
    assert buffers_needed(gm, {"w_1": 0, "v_1": 1}, n_chunk=2) == [1, 1, 0]
