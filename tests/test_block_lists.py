"""Every block list a model has (capture.py), and tied weights read at both ends of the graph (planner/chunking.py,
passes/chunks.py): encoder-decoders have a block list in each stack, and each block one index in the plan; a tied
embedding gets a chunk of its own, gathered again where the head reads it, so offloaded plans need no more buffers
than untied models.

Tolerance: bitwise (CPU, fp32, eager executor), as tests/test_chunk_parity.py: chunked parameters are views of the
same values, gradients the same ops, the update the same fused AdamW kernel; checkpointed blocks recompute the same
ops, swapped activations come back with the same bytes.
"""

import copy

import models
import pytest
import torch
from helpers import ALL_OFFLOADED, BF16_RTOL, train
from torch.utils.checkpoint import CheckpointPolicy

import protrain_fx
from protrain_fx.capture import BETWEEN, POST, PRE
from protrain_fx.passes.views import is_view

STEPS = 3
# (layers: blocks in each stack of an encoder-decoder)
STACKS = {"t5": ("encoder.block", "decoder.block"), "bart": ("model.encoder.layers", "model.decoder.layers")}
PLANS = {
    "persistent": {},
    "offloaded": {**ALL_OFFLOADED, "n_checkpoint": 0, "n_swap": 0},
    # both encoder blocks and the first decoder's (n_swap forced too: the search may swap the fourth)
    "checkpoint": {"n_persist": 0, "n_buffer": 3, "n_checkpoint": 3, "n_swap": 0},
    "swap": {"block_modes": ["swap", "checkpoint", "swap", "none"]},  # a swapped block in each stack
}


def train_both(kind, plan, steps=STEPS, *, prepared=False, **model_kw):
    """`steps` steps of the same model eagerly (torch's fused AdamW) and through the backend with its chunks
    (protrain's AdamW) under `plan` (`prepared`: chunks built by protrain_fx.prepare), checked bitwise step by
    step; (eager model, chunked model, backend)."""
    ref = models.build(kind, **model_kw)
    model = copy.deepcopy(ref)
    if prepared:
        model, plan = protrain_fx.prepare(model, plan=plan, device="cpu"), {}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    eager, losses = train(ref, kind, steps, opt=ref_opt), train(compiled, kind, steps, opt=opt)
    assert losses == eager, f"eager {eager} protrain {losses}"
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name
    return ref, model, backend


def compile_once(kind, **model_kw):
    model = models.build(kind, **model_kw)
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    models.loss_of(kind, compiled(**models.batch(kind))).backward()
    return model, backend.graphs[0]


@pytest.mark.parametrize("kind", models.SEQ2SEQ_KINDS)
def test_blocks_are_found_in_both_stacks(kind, caplog):
    with caplog.at_level("INFO", logger="protrain_fx.capture"):
        _, record = compile_once(kind, layers=2)
    block_map = record.block_map
    assert [(f.parent, f.n_blocks, f.first) for f in block_map.families] == [
        (STACKS[kind][0], 2, 0),
        (STACKS[kind][1], 2, 2),
    ]
    assert block_map.n_blocks == 4 and block_map.blocks_in_graph == [0, 1, 2, 3]
    assert record.plan.n_block == 4
    # outside the blocks: embeddings, the encoder's final norm and the decoder's inputs between the stacks, the
    # head and the loss; counted, few, and logged
    assert block_map.outside[BETWEEN] > 0 and block_map.outside[POST] > 0 and PRE in block_map.outside
    assert 0 < block_map.n_outside < 0.1 * block_map.n_nodes
    assert f"{block_map.n_outside} of {block_map.n_nodes} graph nodes outside" in caplog.text
    assert STACKS[kind][1] in caplog.text
    # the shared embedding is read again by the decoder (before its first block) and by the head (after the last)
    again = {e.name: e.read_again_at for e in record.param_map.values() if e.read_again_at}
    assert list(again.values()) == [(2, 4)]


@pytest.mark.parametrize("plan", PLANS, ids=list(PLANS))
@pytest.mark.parametrize("kind", models.SEQ2SEQ_KINDS)
def test_every_plan_mode_trains_encoder_decoders_as_eager(kind, plan):
    _, model, backend = train_both(kind, PLANS[plan], layers=2)
    record = backend.graphs[0]
    forced = PLANS[plan]
    if forced.get("n_checkpoint"):
        assert record.plan.block_modes == ("checkpoint",) * 3 + ("none",)
        recomputed = {
            record.block_map.block.get(n.name)
            for n in record.backward.graph.nodes
            if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE and not is_view(n)
        }
        # blocks of both stacks (nodes the partitioner made have none; views of offloaded parameters are
        # recomputed in every block: passes/chunks.py)
        assert recomputed - {None} == {0, 1, 2}
    if "block_modes" in forced:
        assert record.plan.block_modes == tuple(forced["block_modes"]) and record.swap.slots
        swapped = {record.block_map.block[n.args[2].name] for n in _swap_outs(record)}
        assert swapped == {0, 2}
    manager = protrain_fx.manager_of(model)
    assert manager.n_persist == (0 if "n_persist" in forced else manager.layout.n_chunk)


def _swap_outs(record):
    return record.forward.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default)


TIED_PLANS = {
    "offloaded": {**ALL_OFFLOADED, "n_checkpoint": 0, "n_swap": 0},
    "checkpoint": {"n_persist": 0, "n_buffer": 3, "n_checkpoint": 2, "n_swap": 0},
}


@pytest.mark.parametrize("plan", TIED_PLANS, ids=list(TIED_PLANS))
@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_tied_embedding_trains_offloaded_with_as_many_buffers_as_untied(kind, plan):
    """The embedding tied to the head is in a chunk of its own, gathered at the forward's start and again for the
    head: every chunk offloaded, two buffers do (three with checkpointing), as for an untied model."""
    _, model, backend = train_both(kind, TIED_PLANS[plan], layers=3)
    manager, record = protrain_fx.manager_of(model), backend.graphs[0]
    tied = manager.slot_of(model.get_output_embeddings().weight)
    assert [s.name for s in manager.layout.chunk_slots(tied.chunk)] == [tied.name]
    gathers = [n.args[1] for n in record.forward.graph.find_nodes(op="call_function", target=_GATHER)]
    assert gathers[0] == gathers[-1] == tied.chunk and gathers.count(tied.chunk) == 2
    assert record.costs.regathers == ((tied.chunk, manager.layout.n_chunk - 1),)  # (priced beside the last chunk)


def test_a_model_checkpointing_its_own_layers_trains_offloaded_as_eager():
    """BART checkpointing its own layers (Hugging Face's gradient checkpointing) with dropout: each recomputed
    dropout saves its generator state, which the decoder's graph (after a graph break: profiled on demand) holds
    through its profile."""
    _, _, backend = train_both("bart", ALL_OFFLOADED, steps=2, checkpointed=True, dropout=0.1)
    assert len([g for g in backend.graphs if g.param_map]) > 1


@pytest.mark.parametrize("prepared", [False, True])
def test_layers_sharing_weights_train_offloaded_with_the_buffers_their_graph_holds(prepared):
    """ALBERT's layers read one layer's chunks again and again: with the embedding persistent, the search gives the
    offloaded chunks as many buffers as the graphs hold at once (passes/chunks.py `buffers_needed`: more than
    two), with which the chunk passes rewrite them; also where `prepare` is given n_persist alone (its chunks then
    wait for the first compile's n_buffer)."""
    _, model, backend = train_both("albert", {"n_persist": 1}, layers=3, prepared=prepared)
    record = backend.graphs[0]
    assert record.planning.least_buffers[1] > 2 and record.plan.n_buffer >= record.planning.least_buffers[1]


def test_a_prepared_model_lays_its_tied_weight_alone():
    """Without a graph to read, `prepare` gives a tied parameter outside the blocks a chunk of its own (one block
    does, and compiles faster)."""
    _, model, backend = train_both("gpt2", TIED_PLANS["offloaded"], prepared=True, layers=1)
    manager = protrain_fx.manager_of(model)
    tied = manager.slot_of(model.get_output_embeddings().weight)
    assert tied.chunk == 0 and [s.name for s in manager.layout.chunk_slots(0)] == [tied.name]
    assert backend.graphs[0].costs.regathers == ((0, manager.layout.n_chunk - 1),)


def test_shared_embedding_of_an_encoder_decoder_is_gathered_for_each_stack_and_the_head():
    _, model, backend = train_both("t5", PLANS["offloaded"], steps=1, layers=2)
    shared = protrain_fx.manager_of(model).slot_of(model.shared.weight)
    gathers = [n.args[1] for n in backend.graphs[0].forward.graph.find_nodes(op="call_function", target=_GATHER)]
    assert gathers.count(shared.chunk) == 3 and gathers[0] == gathers[-1] == shared.chunk


_GATHER = torch.ops.protrain.gather.default


def test_tied_embedding_offloaded_through_inductor():
    """Gathered again under inductor, which schedules a kernel as soon as its inputs exist (the second gather of
    the tied chunk takes the release tokens before it, as every gather does): the inductor tolerance of the other
    tests, losses within 1e-4 (measured: 1e-7 on the first step, equal after). One block (five chunks, the tied
    one alone in chunk 0): inductor's compile time grows with the kernels of the graphs."""
    ref = models.build("gpt2", layers=1)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"plan": TIED_PLANS["offloaded"]})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    expected = train(ref, "gpt2", 3, opt=ref_opt)
    assert train(compiled, "gpt2", 3, opt=opt) == pytest.approx(expected, rel=1e-4)
    gathers = [n.args[1] for n in backend.graphs[0].forward.graph.find_nodes(op="call_function", target=_GATHER)]
    assert gathers.count(0) == 2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind, plan",
    [
        ("gpt2", TIED_PLANS["offloaded"]),
        ("qwen2", TIED_PLANS["checkpoint"]),
        ("t5", PLANS["offloaded"]),
        ("bart", PLANS["checkpoint"]),
    ],
    ids=["gpt2-offloaded", "qwen2-checkpoint", "t5-offloaded", "bart-checkpoint"],
)
def test_tied_and_encoder_decoder_models_offloaded_on_gpu(kind, plan):
    """On the GPU through inductor (uploads on the copy stream; the tied chunk's second gather prefetched after the
    last block chunk's, into the buffer its release frees), fp32 weights under bf16 autocast against eager: the
    bf16 tolerance (helpers.BF16_RTOL) over 5 steps."""
    ref = models.build(kind, layers=2).cuda()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": plan}), dynamic=False)
    expected = train(ref, kind, 5, opt=ref_opt, device="cuda", autocast=torch.bfloat16)
    losses = train(compiled, kind, 5, opt=opt, device="cuda", autocast=torch.bfloat16)
    assert losses == pytest.approx(expected, rel=BF16_RTOL)
    assert protrain_fx.manager_of(model).n_persist == 0
