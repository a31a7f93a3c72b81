"""protrain_fx.what_if (protrain_fx/whatif.py): the plan for a machine you do not have, from a profile taken here.

- A profile of a few blocks scaled to more equals, in every memory figure the planner reads, the profile of the
  model built with more blocks (on the CPU the tracker's bytes are exact; times are not compared: noise).
- The what-if plan for 2 ranks from a 1-rank profile equals the plan 2 gloo ranks make on the same figures: the
  same hardware profile (cost_models.TWO_RANKS) and the same profile (the ranks' own measured one replaced by the
  1-rank profile, which differs from it by timing noise only), under the same GPU and host budgets.
- The largest model that fits, on synthetic profiles whose answer is known.
"""

from __future__ import annotations

import dataclasses
import difflib
import json

import models
import pytest
import torch
from cost_models import H100_LIKE, TWO_RANKS
from spawn import spawn_gloo

import protrain_fx
from protrain_fx.planner.chunking import ParamInfo, layout_at, search_layout
from protrain_fx.planner.inputs import PlanningInputs, cost_model
from protrain_fx.planner.search import NoPlanFits
from protrain_fx.profiler.profile import GraphProfile, NodeProfile, aggregate_blocks
from protrain_fx.whatif import Blocks, param_infos, scaled, what_if

MiB, GiB = 2**20, 2**30


def _profiled(kind: str, layers: int, options: dict | None = None):
    """The record of the graph of `kind` at `layers` blocks, compiled and run once in explain mode (eager)."""
    torch._dynamo.reset()
    backend = protrain_fx.ProTrainBackend({"executor": "eager", **(options or {})}, explain=True)
    model = models.build(kind, layers=layers)
    torch.compile(model, backend=backend, dynamic=False)(**models.batch(kind))
    return max(backend.graphs, key=lambda r: len(r.param_map))


@pytest.fixture
def same_hardware(monkeypatch):
    """Every rank plans with TWO_RANKS, not the hardware it measures under whatever load the tests run with."""
    from protrain_fx.backend import planning

    monkeypatch.setattr(planning, "hardware_profile", lambda device: TWO_RANKS)


def _memory(profile: GraphProfile) -> list[tuple]:
    """What the memory model reads of each node, its bytes from the profile's baseline (the parameters in it
    differ with the block count)."""
    return [
        (n.graph, n.block, n.target, n.allocated_before - profile.baseline_bytes, n.intra_delta_bytes)
        + (n.inter_delta_bytes, n.output_bytes, n.saved_bytes, n.needed_from_block, n.kept_bytes, n.recomputed)
        for n in profile.nodes
    ]


def test_a_profile_of_three_blocks_stands_for_five(same_hardware):
    """The toy (a tied embedding, gathered again for the head) profiled at 3 blocks and scaled to 5 lays out as
    the 5-block model does, and the cost model's memory figures equal those of the 5-block model's profile.
    The 5-block graph has a few more nodes (views of each block's weights AOTAutograd returns at the forward's
    end, no bytes): the nodes are matched by graph, block and op."""
    three, five = _profiled("toy", 3), _profiled("toy", 5)
    profile, inputs = scaled(three.profile, three.planning, 5, 1)
    assert scaled(three.profile, three.planning, 3, 1) == (three.profile, three.planning)  # (nothing to scale)
    assert inputs.layout.chunk_elems == five.planning.layout.chunk_elems
    assert [s.numel for s in inputs.layout.slots] == [s.numel for s in five.planning.layout.slots]
    assert [s.chunk for s in inputs.layout.slots] == [s.chunk for s in five.planning.layout.slots]
    for field in ("n_block", "block_of_param", "regathers", "least_buffers", "other_bytes"):
        assert getattr(inputs, field) == getattr(five.planning, field), field
    assert len(inputs.grad_outputs) == len(five.planning.grad_outputs)
    got, want = _memory(profile), _memory(five.profile)
    matcher = difflib.SequenceMatcher(a=[g[:3] for g in got], b=[w[:3] for w in want], autojunk=False)
    extra = [w for tag, _, _, j1, j2 in matcher.get_opcodes() if tag != "equal" for w in want[j1:j2]]
    assert all(w[0] == "forward" and w[6] == 0 for w in extra), extra  # (views: no new storage)
    assert len(extra) < len(want) // 50
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            assert got[i1:i2] == want[j1:j2]
    ours, theirs = cost_model(profile, inputs), cost_model(five.profile, five.planning)
    for field in ("segments", "block_saved", "block_output", "block_transient", "block_saved_for_later"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.block_chunk == theirs.block_chunk and ours.chunk_params == theirs.chunk_params
    assert profile.peak_bytes - profile.baseline_bytes == five.profile.peak_bytes - five.profile.baseline_bytes


def test_fewer_blocks_and_the_blocks_they_are_like():
    """A middle block repeats (first and last once); for fewer, middle ones are left out."""
    assert Blocks.of(3, 5).order == (0, 1, 1, 1, 2)
    assert Blocks.of(4, 6).order == (0, 1, 2, 2, 2, 3)
    assert Blocks.of(2, 4).order == (0, 1, 1, 1) and Blocks.of(1, 3).order == (0, 0, 0)
    assert Blocks.of(5, 3).order == (0, 1, 4) and Blocks.of(5, 1).order == (0,)
    blocks = Blocks.of(3, 5)
    assert [blocks.copy(b) for b in range(5)] == [0, 0, 1, 2, 0]
    assert blocks.renumber(2) == 4 and blocks.renumber(1, last=True) == 3 and blocks.renumber(3) == 5
    assert blocks.relative(2, 1, 3) == 4 and blocks.relative(2, 0, 0) == 4  # (the next block; what all read)


def test_the_layout_reads_back_with_its_groups():
    """Parameters of two optimizers never share a chunk: the group is read back from where a chunk starts that
    had room; a parameter read again (alone) from the chunks gathered again."""
    params = [ParamInfo("wte", 512, None, alone=True)]
    params += [ParamInfo(f"h.{b}.{k}", 256, b, group=int(b >= 2)) for b in range(4) for k in ("a", "b")]
    params += [ParamInfo("norm", 64, None, group=1)]
    layout = layout_at(params, 2048, 4, 1)
    blocks = [p.block for p in params]
    assert param_infos(layout, blocks, [(0, 4)]) == params
    again = search_layout(params, 4, 2)  # (a chunk a block: where the groups change is not seen, nor needed)
    read = param_infos(again, blocks, [(0, 4)])
    assert layout_at(read, again.chunk_elems, 4, 2) == again


def test_what_if_on_this_machine_is_the_plan_made_here(same_hardware):
    """From a compiled graph, on its own world size, capacities and hardware: the plan the backend made."""
    budgets = {"gpu_memory_bytes": MiB, "host_memory_bytes": 64 * MiB}
    record = _profiled("toy", 4, budgets)
    found = what_if(
        record,
        gpu_memory_bytes=budgets["gpu_memory_bytes"],
        host_memory_bytes=budgets["host_memory_bytes"],
        host_reserve_bytes=0,
        tokens=32,
        largest=False,
    )
    assert found.plan.to_json() == record.plan.to_json()
    assert found.plan.n_persist < found.plan.n_chunk  # (the budget makes it offload: a plan worth comparing)
    assert found.tokens_per_s == pytest.approx(32 / record.plan.predicted_step_s)
    with pytest.raises(ValueError, match="world_size"):
        what_if(record, world_size=0, gpu_memory_bytes=None)
    with pytest.raises(ValueError, match="no fields"):
        what_if(record, gpu_memory_bytes=None, hardware={"h2d": 1.0})
    with pytest.raises(TypeError, match="takes a ProTrainBackend"):
        what_if(object(), gpu_memory_bytes=None)


def _two_ranks_plan(rank: int, world: int, profile_json: str, options: dict, out: str) -> None:
    """One of 2 ranks: explain-mode compile of the toy on TWO_RANKS, with the 1-rank profile in place of the one
    the ranks measure; rank 0 writes its plan to `out`."""
    from protrain_fx.backend import planning, stages

    profiled = GraphProfile.from_json(json.loads(profile_json))
    real = stages.profile_on_every_rank

    def same_profile(run, device):
        measured = real(run, device)  # (the ranks still profile, and agree, as training does)
        assert [(n.graph, n.name) for n in measured.nodes] == [(n.graph, n.name) for n in profiled.nodes]
        return dataclasses.replace(profiled, nodes=[dataclasses.replace(n) for n in profiled.nodes])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planning, "hardware_profile", lambda device: TWO_RANKS)
        patch.setattr(stages, "profile_on_every_rank", same_profile)
        record = _profiled("toy", 4, options)
    assert record.planning.layout.world_size == world
    if rank == 0:
        with open(out, "w") as f:
            json.dump(record.plan.to_json(), f)


def test_the_plan_for_two_ranks_from_one_rank_is_theirs(same_hardware, tmp_path):
    """2 gloo ranks plan the toy under a GPU budget that makes them offload; what_if from a 1-rank profile of it,
    on the same hardware profile and budgets (each rank's host: half the node's), plans the same."""
    options = {"gpu_memory_bytes": MiB, "host_memory_bytes": 64 * MiB}
    one = _profiled("toy", 4, options)
    out = tmp_path / "plan.json"
    spawn_gloo(_Ranks(json.dumps(one.profile.to_json()), options, str(out)), 2)
    theirs = json.loads(out.read_text())
    found = what_if(
        one,
        world_size=2,
        gpu_memory_bytes=options["gpu_memory_bytes"],
        host_memory_bytes=2 * options["host_memory_bytes"],
        host_reserve_bytes=0,
        hardware=TWO_RANKS,
        largest=False,
    )
    assert found.plan.to_json() == theirs
    assert theirs["n_persist"] < theirs["n_chunk"]  # (some chunk sharded across the ranks: a plan worth comparing)
    assert found.plan.predicted_step_s != one.plan.predicted_step_s  # (the ranks' collectives priced)


@dataclasses.dataclass(frozen=True)
class _Ranks:
    """`_two_ranks_plan` as the module-level body spawn_gloo takes (a picklable callable)."""

    profile_json: str
    options: dict
    out: str

    def __call__(self, rank: int, world: int) -> None:
        _two_ranks_plan(rank, world, self.profile_json, self.options, self.out)


# ----- the largest model, on synthetic profiles -----------------------------------------------------------------


def synthetic(
    n_block: int, *, saved: int, params: int | None, world_size: int = 1
) -> tuple[GraphProfile, PlanningInputs]:
    """A profile of `n_block` alike blocks, each saving `saved` bytes for the backward (a forward node that keeps
    them, a backward node that frees them), and, where `params` is given, `params` parameters per block in chunks
    (an embedding of as many before them); GPU-like hardware (H100_LIKE)."""
    nodes = [NodeProfile("embed", "aten.embedding", "forward", "pre", None, 1e-4, 0, 0, 0, saved)]
    held = saved
    for b in range(n_block):
        nodes.append(NodeProfile(f"f{b}", "aten.mm", "forward", "block", b, 1e-3, held, 0, 0, saved, True, saved))
        held += saved
    nodes.append(NodeProfile("head", "aten.mm", "forward", "post", None, 1e-4, held, 0, 0, saved))
    for b in reversed(range(n_block)):
        nodes.append(NodeProfile(f"g{b}", "aten.mm", "backward", "block", b, 2e-3, held, 0, 0, 0))
        held -= saved
    nodes.append(NodeProfile("g_embed", "aten.mm", "backward", "pre", None, 1e-4, held, 0, 0, 0))
    profile = GraphProfile(
        device="cuda:0",
        forward_s=sum(n.latency_s for n in nodes if n.graph == "forward"),
        backward_s=sum(n.latency_s for n in nodes if n.graph == "backward"),
        peak_bytes=held + n_block * saved,
        baseline_bytes=0,
        saved_bytes=n_block * saved,
        nodes=nodes,
        blocks=aggregate_blocks(nodes),
    )
    layout, blocks = None, ()
    if params is not None:
        infos = [ParamInfo("embed.weight", params, None)]
        infos += [ParamInfo(f"h.{b}.w", params, b) for b in range(n_block)]
        layout, blocks = search_layout(infos, 2, world_size), tuple(p.block for p in infos)
    inputs = PlanningInputs(
        forced={},
        n_block=n_block,
        layout=layout,
        block_of_param=blocks,
        regathers=(),
        grad_outputs=frozenset(),
        fused=False,
        hardware=H100_LIKE,
    )
    return profile, inputs


def test_largest_model_of_activations_alone():
    """No chunks, every block keeping its activations (forced): a plan fits while the blocks' saved bytes do,
    so the largest is known: the capacity over a block's bytes (the peak is at the backward's start: every
    block's activations and the embedding's)."""
    saved = 64 * MiB
    source = synthetic(4, saved=saved, params=None)
    forced = {"n_swap": 0, "n_checkpoint": 0, "n_selective": 0}
    capacity = 40 * saved + saved // 2
    found = what_if(source, gpu_memory_bytes=capacity, forced=forced)
    peak = found.plan.predicted_peak_bytes
    assert found.n_block == 4 and peak == cost_model(*source).peak_bytes(dataclasses.replace(_config(found.plan)))
    assert found.largest_n_block == capacity // saved - 1  # (n blocks peak at (n + 1) x saved: the input's too)
    assert found.largest_plan.predicted_peak_bytes <= capacity
    over = what_if(source, gpu_memory_bytes=capacity, forced=forced, n_block=found.largest_n_block + 1, largest=False)
    assert over.plan.predicted_reserved_bytes > capacity  # (forced: kept over capacity, as the backend keeps it)
    small = what_if(source, gpu_memory_bytes=3 * saved, forced=forced)  # (4 blocks do not fit: searched below)
    assert small.plan.predicted_reserved_bytes > 3 * saved and small.largest_n_block == 2
    none = what_if(source, gpu_memory_bytes=saved, forced=forced)
    assert none.largest_n_block == 0 and none.largest_plan is None


def _config(plan):
    from protrain_fx.planner.cost import Candidate

    return Candidate(plan.n_persist, plan.n_buffer, plan.n_swap, plan.n_checkpoint, plan.n_selective)


def test_largest_model_with_the_host_shared_by_a_node():
    """Chunks offloaded to a host that binds: the node's host is shared by its ranks, each of which holds its shard
    of every offloaded chunk, so more ranks on one node fit about the same model, and the same ranks on as many
    nodes (each with that host) about as many times larger. With chunks sharded across the GPUs too (searched), the
    node's GPUs hold what its host cannot: a larger model fits."""
    saved, params = 4 * MiB, 64 * MiB
    source = synthetic(4, saved=saved, params=params)
    machine = {"gpu_memory_bytes": 4 * GiB, "host_memory_bytes": 6 * GiB, "host_reserve_bytes": 0}
    one = what_if(source, **machine, hardware=TWO_RANKS)
    host_only = {"forced": {"n_device_shard": 0}, **machine, "hardware": TWO_RANKS}
    node = what_if(source, world_size=4, **host_only)
    nodes = what_if(source, world_size=4, ranks_per_node=1, **host_only)
    assert one.largest_plan.n_persist < one.largest_plan.n_chunk  # (the host holds what the GPU cannot)
    assert abs(node.largest_n_block - one.largest_n_block) <= 0.1 * one.largest_n_block
    assert nodes.largest_n_block >= 3 * one.largest_n_block
    sharded = what_if(source, world_size=4, **machine, hardware=TWO_RANKS)
    assert sharded.largest_n_block > node.largest_n_block and sharded.largest_plan.n_device_shard > 0
    assert nodes.largest_n_params == (nodes.largest_n_block + 1) * params
    with pytest.raises(NoPlanFits):
        what_if(source, **machine, hardware=TWO_RANKS, n_block=one.largest_n_block + 1, largest=False)
    over = what_if(source, **machine, hardware=TWO_RANKS, n_block=one.largest_n_block + 1)
    # (fitting is not strictly monotone in the blocks: the chunk layout's padding moves; searched from below, the
    # boundary found may be a lower one)
    assert over.plan is None and "host" in over.no_fit
    assert one.largest_n_block - 2 <= over.largest_n_block <= one.largest_n_block
    assert "no plan fits" in str(over) and "largest that fits" in str(over)
    with pytest.raises(NoPlanFits, match="4 ranks share this machine's host"):  # (what the node lacks)
        what_if(source, world_size=4, **host_only, n_block=2 * node.largest_n_block, largest=False)
