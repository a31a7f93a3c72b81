"""Per-block activation checkpointing: the plan's block modes, the tagging pass, and training equal to eager.

Tolerance: bitwise (CPU, fp32, eager executor). Recomputed ops are the same kernels on the same inputs, and
random ops recompute with the forward's RNG state, so dropout masks match and gradients are identical. On a GPU
under bf16 autocast: helpers.BF16_RTOL.
"""

import copy

import models
import pytest
import torch
from helpers import BF16_RTOL, eager_and_protrain, saved_activation_bytes, train, train_against_autocast

import protrain_fx
from protrain_fx.planner.plan import interleaved_modes, make_plan

LAYOUTS = {
    "none": {},
    "all": {"n_checkpoint": 3},
    "interleaved": {"n_checkpoint": 2},
    "odd-list": {"block_modes": ["checkpoint", "none", "checkpoint"]},
}


def _compiled(kind, plan, **kw):
    ref = models.build(kind, layers=3, **kw)
    model = copy.deepcopy(ref)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan})
    return ref, model, backend, torch.compile(model, backend=backend, dynamic=False)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("kind", ["toy", "llama", "opt"])
def test_checkpointed_training_equals_eager_with_dropout(kind, layout):
    ref, model, backend, compiled = _compiled(kind, LAYOUTS[layout], dropout=0.1)
    assert train(compiled, kind, 3) == train(ref, kind, 3)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    plan = next(g.plan for g in backend.graphs if g.param_map)
    assert plan.n_checkpoint == plan.block_modes.count("checkpoint")


def test_release_waits_for_every_reader_and_holds_no_recomputed_activation():
    """Offloaded chunks in a checkpointed backward: each release follows every reader of its chunk through the
    values it waits on, and waits on none that another of them is computed from (those would stay alive to
    the release: a whole recomputed block)."""
    import networkx as nx

    model = models.build("llama", layers=3)
    protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend(
        {"executor": "eager", "plan": {"n_persist": 0, "n_buffer": 3, "n_checkpoint": 3}}
    )
    compiled = torch.compile(model, backend=backend, dynamic=False)
    models.loss_of("llama", compiled(**models.batch("llama"))).backward()
    for gm in (backend.graphs[0].forward, backend.graphs[0].backward):
        graph = gm.graph
        dag = nx.DiGraph((a, n) for n in graph.nodes for a in n.all_input_nodes)
        releases = list(graph.find_nodes(op="call_function", target=torch.ops.protrain.release.default))
        assert releases
        for release in releases:
            deps = release.args[2]
            before = set(deps).union(*(nx.ancestors(dag, d) for d in deps))
            gather = next(
                n for n in graph.nodes if n.target is torch.ops.protrain.gather.default and n.args[1] == release.args[1]
            )
            readers = [
                n
                for n in graph.nodes
                if n.op == "call_function"
                and not getattr(n.target, "is_view", False)
                and n.target
                not in (
                    torch.ops.protrain.release.default,
                    torch.ops.protrain.prefetch.default,
                    torch.ops.protrain.materialize.default,
                )
                and _reads_directly(n, gather)
            ]
            assert readers and all(r in before for r in readers), (release, [r for r in readers if r not in before])
            assert not any(a in nx.ancestors(dag, b) for a in deps for b in deps), release


def _reads_directly(node, gather) -> bool:
    """Whether `node` reads the gathered chunk through views only."""
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n is gather:
            return True
        if n.op == "call_function" and getattr(n.target, "is_view", False):
            stack.extend(n.all_input_nodes)
    return False


def test_checkpoint_with_offloaded_chunks():
    """Recomputation in the backward reads parameters of offloaded chunks: the backward gathers them first."""
    ref = models.build("llama", layers=3)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"executor": "eager", "plan": {"n_persist": 0, "n_buffer": 3, "n_checkpoint": 2}}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    assert train(compiled, "llama", 3, opt=opt) == train(ref, "llama", 3, opt=ref_opt)
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name


def _saved_bytes(kind, plan):
    """Activation bytes the compiled forward keeps for backward, seen by saved-tensor hooks."""
    _, model, backend, compiled = _compiled(kind, plan)
    batch = models.batch(kind)
    compiled(**batch)
    return saved_activation_bytes(compiled, model, batch), backend.graphs[0]


@pytest.mark.parametrize("kind", ["toy", "llama"])
def test_saved_activations_fall_by_each_checkpointed_block(kind):
    full, record = _saved_bytes(kind, {})
    per_block = [b.saved_bytes for b in record.profile.blocks]
    # a checkpointed middle block keeps none of its own activations, only its input (one hidden state, unless
    # the previous block saved it already) and, when it has random ops, the RNG state to replay them with
    middle, _ = _saved_bytes(kind, {"block_modes": ["none", "checkpoint", "none"]})
    hidden = 2 * 16 * 32 * 4  # batch, sequence, width, fp32
    rng_state = torch.get_rng_state().numel()
    assert full - per_block[1] <= middle <= full - per_block[1] + hidden + rng_state, (full, per_block, middle)
    assert record.plan.n_checkpoint == record.plan.n_swap == 0  # (so `full` is n_checkpoint 0's)
    sizes = [full] + [_saved_bytes(kind, {"n_checkpoint": k})[0] for k in range(1, 4)]
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes


def test_backward_recomputes_the_checkpointed_block():
    _, _, backend, compiled = _compiled("toy", {"block_modes": ["none", "checkpoint", "none"]})
    compiled(**models.batch("toy")).backward()
    _, _, plain, compiled_plain = _compiled("toy", {})
    compiled_plain(**models.batch("toy")).backward()

    def matmuls(gm):
        return sum(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for n in gm.graph.nodes)

    # the block's 4 linear layers run again in the backward; the forward is unchanged
    assert matmuls(backend.graphs[0].backward) == matmuls(plain.graphs[0].backward) + 4
    assert matmuls(backend.graphs[0].forward) == matmuls(plain.graphs[0].forward)


def test_interleaved_layout_is_the_papers():
    assert interleaved_modes(8, 2, 4) == (
        "swap",
        "checkpoint",
        "checkpoint",
        "swap",
        "checkpoint",
        "checkpoint",
        "none",
        "none",
    )
    assert interleaved_modes(4, 0, 2) == ("checkpoint", "checkpoint", "none", "none")
    assert interleaved_modes(3, 0, 0) == ("none",) * 3


def test_block_mode_errors():
    with pytest.raises(ValueError, match="n_swap=2 and n_checkpoint=2, more than the model's 3 blocks"):
        make_plan(3, {"n_swap": 2, "n_checkpoint": 2})
    with pytest.raises(ValueError, match="more than the model's 3 blocks"):
        make_plan(3, {"n_checkpoint": 4})
    with pytest.raises(ValueError, match="n_checkpoint'\\]=1 disagrees with block_modes"):
        make_plan(3, {"n_checkpoint": 1, "block_modes": ["checkpoint"] * 3})
    with pytest.raises(ValueError, match="has 2 entries but the model has 3 blocks"):
        make_plan(3, {"block_modes": ["none"] * 2})
    with pytest.raises(ValueError, match="unknown mode"):
        make_plan(3, {"block_modes": ["none", "recompute", "none"]})


def test_checkpoint_pass_alone():
    """Only forward ops of blocks in "checkpoint" mode get tags; a plan without checkpoint leaves the graph as it is."""
    import types

    from torch import fx
    from torch.utils.checkpoint import CheckpointPolicy

    from protrain_fx.capture import BlockMap
    from protrain_fx.passes.activations import checkpoint_tag_pass

    def f(x):
        a = torch.sin(x)  # block 0
        b = torch.cos(a)  # block 1
        c = torch.exp(b)  # block 1, backward
        return torch.neg(c)  # post

    gm = fx.symbolic_trace(f)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    gm.graph.find_nodes(op="call_function", target=torch.exp)[0].meta["partitioner_tag"] = "is_backward"
    block_map = BlockMap(
        families=(),
        region=dict(zip(names, ["block", "block", "block", "post"])),
        block=dict(zip(names, [0, 1, 1, None])),
    )
    record = types.SimpleNamespace(block_map=block_map)
    untouched = checkpoint_tag_pass(gm, types.SimpleNamespace(plan=make_plan(2), record=record))
    assert not any("recompute" in n.meta for n in untouched.graph.nodes)
    plan = make_plan(2, {"block_modes": ["none", "checkpoint"]})
    tagged = checkpoint_tag_pass(gm, types.SimpleNamespace(plan=plan, record=record))
    tags = {n.name: (n.meta.get("recompute"), n.meta.get("ac_graph_id")) for n in tagged.graph.nodes}
    assert tags["cos"] == (CheckpointPolicy.MUST_RECOMPUTE, 2)
    assert tags["sin"] == tags["exp"] == tags["neg"] == (None, None)
    assert tagged(torch.ones(3)).equal(f(torch.ones(3)))


@pytest.mark.parametrize("kind", ["toy", "llama"])
def test_recompute_waits_for_the_backward_before_it(kind):
    """Any schedule of the backward graph (inductor's fusions included) runs a checkpointed block's recompute
    only after the gradients computed ahead of it in the graph: two blocks' recomputed activations are never
    alive at once."""
    import networkx as nx
    from torch.utils.checkpoint import CheckpointPolicy

    _, _, backend, compiled = _compiled(kind, {"n_checkpoint": 3})
    models.loss_of(kind, compiled(**models.batch(kind))).backward()
    graph = backend.graphs[0].backward.graph
    dag = nx.DiGraph((a, n) for n in graph.nodes for a in n.all_input_nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    grads = [a for a in graph.output_node().all_input_nodes if a.op != "placeholder"]
    regions = {}
    for n in graph.nodes:
        if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
            regions.setdefault(n.meta["ac_graph_id"], []).append(n)
    assert len(regions) == 3, regions.keys()
    for nodes in regions.values():
        ahead = {g for g in grads if order[g] < order[nodes[0]]}
        for n in nodes:
            activations = [
                a
                for a in n.all_input_nodes
                if not a.name.startswith("primals")
                and isinstance(a.meta.get("val"), torch.Tensor)
                and a.meta["val"].numel()
            ]
            if activations and not any(a in nodes for a in n.all_input_nodes):
                assert ahead <= nx.ancestors(dag, n), (n.name, sorted(g.name for g in ahead - nx.ancestors(dag, n)))
    copied = [n.args[0] for n in graph.nodes if n.target is torch.ops.protrain.after.default]
    assert copied and not any(a.name.startswith("primals") for a in copied), copied  # activations, never weights
    # a region's copies wait on the same values; a gradient waited on by every later region would live to the end
    waits = [
        d
        for deps in {tuple(n.args[1]) for n in graph.nodes if n.target is torch.ops.protrain.after.default}
        for d in deps
    ]
    assert len(waits) == len(set(waits))


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [{"n_checkpoint": 2}, {"block_modes": ["checkpoint", "none", "checkpoint", "none"]}])
def test_checkpointed_bf16_parity(plan):
    """Checkpointed blocks through inductor on the GPU, bf16 autocast, dropout on: the bf16 tolerance."""
    (eager_losses, _), (losses, _), backend = eager_and_protrain(
        "llama", steps=5, options={"plan": plan}, device="cuda", autocast=torch.bfloat16, layers=4, dropout=0.1
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=BF16_RTOL, atol=1e-3)
    assert backend.graphs[0].plan.n_checkpoint == 2


@pytest.mark.gpu
def test_recomputed_attention_keeps_its_layout_rule(monkeypatch):
    """A checkpointed block's fused attention is a random op (for its dropout, even at 0), so AOTAutograd wraps
    its recompute in `graphsafe_run_with_rng_state`, which inductor lowers without the attention's stride rule;
    the backend's lowering of the wrapper restores it (runtime/ops.py `_dense_recomputed_attention`: cuDNN failed
    on a query strided in its head dimension, training the 5.5B on four ranks). The recomputed attention is
    lowered through it, and training keeps the bf16 tolerance."""
    from torch._inductor.lowering import lowerings
    from torch._prims.rng_prims import graphsafe_run_with_rng_state

    from protrain_fx.runtime.ops import register_inductor_lowering

    register_inductor_lowering()
    ours, wrapped = lowerings[graphsafe_run_with_rng_state], []
    assert ours.protrain_dense_attention

    def spy(op, *args, **kwargs):
        wrapped.append(op._opname)
        return ours(op, *args, **kwargs)

    monkeypatch.setitem(lowerings, graphsafe_run_with_rng_state, spy)
    ref = models.build("llama", layers=4).cuda()
    ref.config._attn_implementation = "sdpa"  # (the test models' own is the eager attention: no fused op)
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"plan": {"n_checkpoint": 2}}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    train_against_autocast(ref, ref_opt, compiled, opt, steps=3)
    assert any(name.startswith("_scaled_dot_product") for name in wrapped), wrapped
