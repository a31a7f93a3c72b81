"""Per-block activation swapping: saved tensors of swapped blocks go to host slots after their last forward use
and come back before their first backward use (runtime/swap.py, passes/activations.py).

Tolerance: bitwise (CPU, fp32, eager executor): a swapped tensor comes back with the same bytes, and the
ops that read it are unchanged. On the CPU the copies go CPU to CPU through the same slots and ops.
"""

import copy

import models
import pytest
import torch
from helpers import losses_side_by_side, saved_activation_bytes, train

import protrain_fx

LAYOUTS = {
    "all-swap": {"n_swap": 3},
    "mix": {"n_swap": 1, "n_checkpoint": 2},
    "odd-list": {"block_modes": ["checkpoint", "swap", "none"]},
}


def _compiled(kind, options, **kw):
    ref = models.build(kind, layers=3, **kw)
    model = copy.deepcopy(ref)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", **options})
    return ref, model, backend, torch.compile(model, backend=backend, dynamic=False)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("kind", ["toy", "llama", "mistral", "opt"])
def test_swapped_training_equals_eager_with_dropout(kind, layout):
    ref, model, backend, compiled = _compiled(kind, {"plan": LAYOUTS[layout]}, dropout=0.1)
    assert train(compiled, kind, 3) == train(ref, kind, 3)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    record = next(g for g in backend.graphs if g.param_map)
    assert record.swap is not None and record.swap.slots


def test_swap_with_offloaded_chunks_and_inductor():
    """Swapped activations next to offloaded chunks, through inductor (the ops are fallback kernels there):
    the inductor tolerance of the other tests, losses 1e-4."""
    ref = models.build("llama", layers=3)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"plan": {"n_persist": 1, "n_buffer": 3, "n_swap": 2}}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    for ref_loss, loss in losses_side_by_side("llama", ref, ref_opt, compiled, opt):
        assert loss == pytest.approx(ref_loss, rel=1e-4)


def _saved_outside_swap(kind, plan):
    """Activation bytes the forward keeps for backward outside the host swap slots, and the graph record."""
    _, model, backend, compiled = _compiled(kind, {"plan": plan})
    batch = models.batch(kind)
    compiled(**batch)
    record = backend.graphs[0]
    exclude = [record.swap.arena] if record.swap is not None else []
    return saved_activation_bytes(compiled, model, batch, exclude), record


@pytest.mark.parametrize("kind", ["toy", "llama"])
def test_swapped_block_keeps_nothing_on_the_device(kind):
    full, plain = _saved_outside_swap(kind, {})
    middle, record = _saved_outside_swap(kind, {"block_modes": ["none", "swap", "none"]})
    assert middle == full - plain.profile.blocks[1].saved_bytes
    slots = record.swap.slots
    # the arena holds exactly the swapped tensors (64-byte aligned), allocated once
    assert record.swap.arena.numel() == sum(-(-s.numel() * s.element_size() // 64) * 64 for s in slots)
    assert sum(s.numel() * s.element_size() for s in slots) >= plain.profile.blocks[1].saved_bytes


def test_swap_passes_rewrite_only_swapped_blocks():
    _, _, backend, compiled = _compiled("toy", {"plan": {"block_modes": ["none", "swap", "none"]}})
    compiled(**models.batch("toy")).backward()
    record = backend.graphs[0]
    fw, bw = record.forward, record.backward
    outs = [n for n in fw.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default)]
    ins = bw.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_in.default)
    prefetches = bw.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_prefetch.default)
    assert len(outs) == len(ins) == len(record.swap.slots) > 0 and 0 < len(prefetches) <= len(ins)
    assert {record.block_map.block[n.args[2].name] for n in outs} == {1}
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    for n in ins:  # each swap_in comes before every reader and after its prefetch
        assert all(order[u] > order[n] for u in n.users)
    for p in prefetches:  # each prefetch comes before the swap_in of its slot
        assert any(order[p] < order[n] and p.args[1] == n.args[1] for n in ins)
    _, _, plain, compiled_plain = _compiled("toy", {})
    compiled_plain(**models.batch("toy")).backward()
    for gm in (plain.graphs[0].forward, plain.graphs[0].backward):
        assert not any("swap" in str(n.target) for n in gm.graph.nodes)
