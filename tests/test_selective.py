"""Selective blocks: the plan's mode, the tags, what a selective block keeps and recomputes, and training equal to
eager training with selective blocks beside checkpointed and swapped ones, offloaded chunks and graph breaks.

Tolerance: bitwise with the eager executor (CPU, fp32). A selective block's backward runs the same kernels on the
same inputs: its kept matmul outputs are the forward's, its recomputed ops run again on them, and random ops
replay the forward's RNG state, so dropout masks, losses and parameters are identical. The inductor executor fuses
ops and changes reduction order: there losses agree with eager training to 1e-4 relative (as in test_parity.py),
and parameters to steps * lr (AdamW normalizes each update to about lr, so a gradient near zero can flip sign). On
a GPU under bf16 autocast: helpers.BF16_RTOL.
"""

import copy
import types

import models
import pytest
import torch
from helpers import BF16_RTOL, bf16_chunks_against_autocast, eager_and_protrain, saved_activation_bytes, train
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

import protrain_fx
from protrain_fx.capture import BlockMap
from protrain_fx.passes.activations import checkpoint_tag_pass
from protrain_fx.planner.plan import interleaved_modes, make_plan

MIXED = {
    "selective-checkpoint": {"block_modes": ["selective", "checkpoint", "none"]},
    "all-selective": {"n_selective": 3},
    "swap-selective": {"block_modes": ["swap", "selective", "checkpoint"], "swap_interval": 1},
}


def _compiled(kind, plan, *, executor="eager", layers=3, **kw):
    ref = models.build(kind, layers=layers, **kw)
    model = copy.deepcopy(ref)
    backend = protrain_fx.ProTrainBackend({"executor": executor, "plan": plan})
    return ref, model, backend, torch.compile(model, backend=backend, dynamic=False)


@pytest.mark.parametrize("layout", MIXED, ids=list(MIXED))
@pytest.mark.parametrize("kind", ["llama", "gpt2", "opt"])
def test_selective_training_equals_eager_with_dropout(kind, layout):
    ref, model, backend, compiled = _compiled(kind, MIXED[layout], dropout=0.1)
    assert train(compiled, kind, 3) == train(ref, kind, 3)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    plan = next(g.plan for g in backend.graphs if g.param_map)
    assert plan.n_selective == plan.block_modes.count("selective") > 0


def test_selective_with_offloaded_chunks():
    """Every chunk offloaded, two buffers: a selective block's recompute reads its norm weights in the backward,
    which the backward gathers first; a checkpointed block beside it needs a third buffer."""
    kind = "llama"
    for modes, buffers in ((["selective", "selective", "none"], 2), (["selective", "checkpoint", "selective"], 3)):
        ref = models.build(kind, layers=3, dropout=0.1)
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
        plan = {"n_persist": 0, "n_buffer": buffers, "block_modes": modes}
        compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan}))
        assert train(compiled, kind, 3, opt=opt) == train(ref, kind, 3, opt=ref_opt), modes
        state = protrain_fx.full_state_dict(model)
        for name, value in ref.state_dict().items():
            assert torch.equal(state[name], value), (modes, name)


def test_selective_across_a_graph_break():
    """The toy model broken into two graphs after its first block: each graph's blocks take their modes."""
    ref = models.build("toy", layers=3, dropout=0.1, graph_break_after=0)
    model = copy.deepcopy(ref)
    backend = protrain_fx.ProTrainBackend(
        {"executor": "eager", "plan": {"block_modes": ["selective", "selective", "checkpoint"]}}
    )
    compiled = torch.compile(model, backend=backend, dynamic=False)
    assert train(compiled, "toy", 3) == train(ref, "toy", 3)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert len([g for g in backend.graphs if g.param_map]) == 2


def test_selective_under_inductor():
    """Inductor compiles the re-cut graphs (no dropout: inductor draws random numbers its own way): a selective
    block beside a checkpointed one, two blocks (inductor's compile time grows with the kernels of the graph;
    plain blocks beside selective ones are tested with the eager executor above)."""
    plan = {"block_modes": ["selective", "checkpoint"]}
    ref, model, backend, compiled = _compiled("llama", plan, executor="inductor", layers=2)
    losses, expected = train(compiled, "llama", 3), train(ref, "llama", 3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-6)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=3 * 1e-2)
    assert backend.graphs[0].plan.n_selective == 1


def _saved(kind, plan, executor="eager"):
    """Activation bytes the compiled forward keeps for backward (saved-tensor hooks), and its graph record."""
    _, model, backend, compiled = _compiled(kind, plan, executor=executor)
    batch = models.batch(kind)
    compiled(**batch)
    return saved_activation_bytes(compiled, model, batch), backend.graphs[0]


@pytest.fixture(scope="module")
def saved():
    """`_saved(kind, plan)`, each (kind, plan) compiled once in the module: its tests read what it measured and
    the record's graphs, profile and cost model, and change none of them."""
    done = {}

    def get(kind, plan):
        key = kind, repr(sorted(plan.items()))
        if key not in done:
            done[key] = _saved(kind, plan)
        return done[key]

    return get


@pytest.mark.parametrize("kind", ["toy", "llama", "gpt2", "opt"])
def test_a_selective_block_keeps_what_the_cost_model_says(kind, saved):
    """Without dropout (a recomputed random op also keeps its RNG state, which the cost model leaves out), the
    bytes a selective block saves less than the same block unoptimized are the cost model's `saving`, to the
    byte, for one block and for all."""
    full, record = saved(kind, {})
    costs = record.costs
    assert costs.prices_selective and 0 < costs.saving(1, "selective") < costs.block_saved[1]
    middle, _ = saved(kind, {"block_modes": ["none", "selective", "none"]})
    assert full - middle == costs.saving(1, "selective"), (full, middle, costs.block_saved, costs.block_kept)
    everywhere, _ = saved(kind, {"n_selective": 3})
    assert full - everywhere == sum(costs.saving(b, "selective") for b in range(3))


def test_marks_are_what_the_partitioner_does(saved):
    """`profiler/selective.py` says which forward nodes a selective block keeps and recomputes before any
    partition is made: the re-cut graphs save the kept nodes of the block (or views of them) and nothing else of
    it, and the backward recomputes exactly the marked ones."""
    from protrain_fx.passes.views import view_base

    _, plain = saved("llama", {})
    _, record = saved("llama", {"block_modes": ["none", "selective", "none"]})
    nodes = [n for n in plain.profile.nodes if n.graph == "forward" and n.block == 1]
    in_block = {n.name for n in nodes}
    forward = {n.name: n for n in record.forward.graph.nodes}
    saved = {n.name for n in record.backward.graph.find_nodes(op="placeholder") if n.name in in_block}
    assert {view_base(forward[name]).name for name in saved} == {n.name for n in nodes if n.kept_bytes}
    again = {
        n.name
        for n in record.backward.graph.nodes
        if n.op == "call_function" and n.name in in_block and "recompute" in n.meta
    }
    assert again == {n.name for n in nodes if n.recomputed}
    assert all(record.backward.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default))


def test_selective_tags_alone():
    """Library kernels and the block's output get MUST_SAVE, the rest PREFER_RECOMPUTE, only in selective blocks;
    a plan without recompute leaves the graph as it is; the tagged graph computes the same values."""

    aten = torch.ops.aten

    def f(x, w):
        a = aten.mm.default(aten.relu.default(x), w)  # block 0: relu recomputed, mm kept
        b = aten.add.Tensor(aten.sin.default(a), a)  # block 0: the add is the block's output
        return aten.sum.default(aten.mm.default(b, w))  # block 1, then after the blocks

    gm = fx.symbolic_trace(f)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    blocks = dict(zip(names, [0, 0, 0, 0, 1, None]))
    region = {n: "block" if b is not None else "post" for n, b in blocks.items()}
    record = types.SimpleNamespace(block_map=BlockMap(families=(), region=region, block=blocks))
    untouched = checkpoint_tag_pass(gm, types.SimpleNamespace(plan=make_plan(2), record=record))
    assert not any("recompute" in n.meta for n in untouched.graph.nodes)
    plan = make_plan(2, {"block_modes": ["selective", "none"]})
    tagged = checkpoint_tag_pass(gm, types.SimpleNamespace(plan=plan, record=record))
    calls = [n for n in tagged.graph.nodes if n.op == "call_function"]
    tags = {n.name: n.meta.get("recompute") for n in calls}
    assert [tags[n] for n in names[:4]] == [
        CheckpointPolicy.PREFER_RECOMPUTE,  # relu
        CheckpointPolicy.MUST_SAVE,  # mm
        CheckpointPolicy.PREFER_RECOMPUTE,  # sin
        CheckpointPolicy.MUST_SAVE,  # add: read by block 1
    ]
    assert tags[names[4]] is None and tags[names[5]] is None
    assert [n.meta.get("ac_graph_id") for n in calls] == [1, 1, 1, 1, None, None]
    x, w = torch.randn(3, 3), torch.randn(3, 3)
    assert tagged(x, w).equal(f(x, w))


def test_interleaved_layout_with_selective_blocks():
    assert interleaved_modes(8, 2, 2, 2) == (
        "swap",
        "checkpoint",
        "checkpoint",
        "swap",
        "selective",
        "selective",
        "none",
        "none",
    )
    assert interleaved_modes(8, 2, 0, 6) == ("swap",) + ("selective",) * 3 + ("swap",) + ("selective",) * 3
    assert interleaved_modes(4, 0, 1, 2) == ("checkpoint", "selective", "selective", "none")
    assert interleaved_modes(8, 2, 4) == interleaved_modes(8, 2, 4, 0)  # (the paper's layout unchanged)
    plan = make_plan(4, {"n_selective": 2, "n_checkpoint": 1})
    assert plan.block_modes == ("checkpoint", "selective", "selective", "none") and plan.n_selective == 2
    assert "cll" in str(plan)


def test_selective_mode_errors():
    with pytest.raises(ValueError, match="n_checkpoint=2 and n_selective=2, more than the model's 3 blocks"):
        make_plan(3, {"n_checkpoint": 2, "n_selective": 2})
    with pytest.raises(ValueError, match="n_selective'\\]=1 disagrees with block_modes, which has 2 'selective'"):
        make_plan(3, {"n_selective": 1, "block_modes": ["selective", "selective", "none"]})
    with pytest.raises(ValueError, match="n_selective'\\] must be a non-negative int"):
        make_plan(3, {"n_selective": -1})
    assert make_plan(3, {"n_selective": 0, "block_modes": ["none"] * 3}).n_selective == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan",
    [
        {"n_selective": 4},
        {"block_modes": ["selective", "checkpoint", "selective", "none"]},
        {"block_modes": ["swap", "selective", "selective", "none"], "swap_interval": 1},
    ],
)
def test_selective_bf16_parity(plan):
    """Selective blocks (beside checkpointed and swapped ones) through inductor on the GPU, bf16 autocast, dropout
    on: the bf16 tolerance; the matmuls (the test models' eager attention's too) are kept, not recomputed."""
    (eager_losses, _), (losses, _), backend = eager_and_protrain(
        "llama", steps=5, options={"plan": plan}, device="cuda", autocast=torch.bfloat16, layers=4, dropout=0.1
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=BF16_RTOL, atol=1e-3)
    record = backend.graphs[0]
    assert record.plan.n_selective == record.plan.block_modes.count("selective") > 0
    matmuls = [
        n for n in record.profile.nodes if n.graph == "forward" and n.target in ("aten.mm.default", "aten.bmm.default")
    ]
    assert matmuls and all(not n.recomputed for n in matmuls)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan",
    [
        {"n_persist": 0, "n_buffer": 2, "n_selective": 4},
        {"n_persist": 1, "n_buffer": 3, "block_modes": ["selective", "checkpoint", "selective", "none"]},
    ],
)
def test_selective_with_offloaded_chunks_bf16_parity(plan):
    """Selective blocks over offloaded chunks (inductor, fp32 masters) against eager fp32 training under bf16
    autocast: the bf16 tolerance on losses."""
    bf16_chunks_against_autocast({"plan": plan})
