"""The chunk passes alone, on a small graph: they rewrite what is tagged, leave an untagged graph unchanged,
and the rewritten graph computes the same values."""

import types

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from protrain_fx.passes.chunks import TAG, ParamTag, chunk_gather_pass, grad_reduce_pass
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
    assert grad_reduce_pass(gm, types.SimpleNamespace(stage="backward", forward_placeholders=[])).code == before


def test_tagged_graph_gathers_and_computes_the_same():
    w1, w2, x, expected, gm = setup()
    layout = layout_at(
        [ParamInfo("w1", 32, None), ParamInfo("w2", 24, None)], chunk_elems=64, element_size=4, world_size=1
    )
    manager = ChunkManager([w1, w2], layout, n_persist=0, n_buffer=1)  # one chunk, offloaded: storages emptied
    assert w1.untyped_storage().nbytes() == 0
    for node, param in zip([n for n in gm.graph.nodes if n.op == "placeholder"], [w1, w2]):
        slot = manager.slot_of(param)
        node.meta[TAG] = ParamTag(manager.handle, manager.index[id(param)], slot.chunk, slot.offset, slot.numel, False)
    ctx = types.SimpleNamespace(manager=manager, stage="forward")
    gm = chunk_gather_pass(gm, ctx)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.protrain.gather.default) == 1
    assert targets.count(torch.ops.protrain.release.default) == 1
    assert targets.index(torch.ops.protrain.gather.default) < targets.index(torch.ops.aten.t.default)
    # released after the last reader of the chunk's parameters (the second matmul)
    assert targets.index(torch.ops.protrain.release.default) > max(
        i for i, t in enumerate(targets) if t is torch.ops.aten.mm.default
    )
    torch.testing.assert_close(gm(w1, w2, x), expected, rtol=0, atol=0)


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
    ctx = types.SimpleNamespace(manager=manager, stage="backward", forward_placeholders=forward_placeholders)
    bw = grad_reduce_pass(bw, ctx)
    assert bw(torch.ones(8, 4), torch.ones(3, 8)) == (None, None)
    assert torch.equal(manager.grad[0][:32], torch.full((32,), 2.0)) and torch.equal(
        manager.grad[0][32:56], torch.full((24,), 2.0)
    )
