"""Selective blocks in the cost models and the search (planner/selective.py, planner/cost.py, planner/search.py),
on synthetic profiles with GPU-like hardware figures (cost_models.py): the price of a selective block, the search
equal to brute force with selective blocks in its space, selective winning where its recompute is cheap and memory
tight and losing where memory is plenty or its recompute dear, and the bounds the search prunes with."""

import dataclasses

import pytest
from cost_models import beside_matmuls, capacities, linked, on_two_ranks, synthetic

from protrain_fx.planner.chunking import ChunkLayout
from protrain_fx.planner.cost import Candidate, CostModel
from protrain_fx.planner.search import (
    CLIP_WEIGHT,
    HOST_SLOWDOWN,
    brute_force,
    plan_graph,
    rank,
    ranked_step_s,
    search,
)
from protrain_fx.profiler.profile import GraphProfile, NodeProfile, aggregate_blocks


def selective(model: CostModel, kept: float = 0.4, recompute: float = 0.1) -> CostModel:
    """`model` whose selective blocks keep `kept` of their saved bytes and recompute in `recompute` of their
    forward's time, with a spike of an eighth of their saved bytes."""
    return dataclasses.replace(
        model,
        block_kept=tuple(int(s * kept) for s in model.block_saved),
        block_selective_s=tuple(t * recompute for t in model.block_fwd_s),
        block_selective_transient=tuple(s // 8 for s in model.block_saved),
    )


@pytest.mark.parametrize("seed", range(3))
def test_search_with_selective_blocks_finds_the_brute_force_optimum(seed):
    """With n_selective in the space (and the host budgeted or not), pruning never changes the optimum nor its
    runners-up."""
    model = selective(synthetic(seed=seed, n_block=5 + seed, n_chunk=4 + seed), recompute=0.05 + 0.1 * seed)
    for capacity in capacities(model):
        unbudgeted = brute_force(model, capacity)  # (the expected configurations with no host budget too)
        needs = sorted({model.least_host_bytes(c) for c, _, _ in unbudgeted})
        for host in (None, needs[len(needs) // 2]):
            best, runners_up = search(model, capacity, host_bytes=host)
            fits = unbudgeted if host is None else brute_force(model, capacity, host_bytes=host)
            expected, expected_runners_up = rank(fits, capacity)
            assert (best, runners_up) == (expected, expected_runners_up), (capacity, host)


def test_selective_wins_where_its_recompute_is_cheap_and_memory_tight():
    """Selective blocks save most of a block's activations for a twentieth of its forward: where every chunk fits
    on the GPU only with every block selective, the searched plan keeps the chunks there with selective blocks,
    and is faster than the best plan without them (which checkpoints whole forwards, swaps, or offloads
    chunks)."""
    model = selective(synthetic(n_block=8, n_chunk=6), kept=0.3, recompute=0.05)
    capacity = model.reserved_bytes(Candidate(n_persist=6, n_selective=8))
    (best, step, _), _ = search(model, capacity)
    (without, step_without, _), _ = search(model, capacity, {"n_selective": 0})
    assert best.n_selective > 0 and best.n_checkpoint == 0, best
    assert without.n_checkpoint + without.n_swap > 0 or without.n_persist < 6, without
    assert step < step_without
    assert model.reserved_bytes(best) <= capacity


def test_selective_loses_where_memory_is_plenty():
    """No capacity (or one every activation fits): nothing is recomputed, selective blocks cost time for
    nothing."""
    model = selective(synthetic(n_block=8, n_chunk=6), kept=0.3, recompute=0.05)
    for capacity in (None, capacities(model)[-1]):
        (best, _, _), _ = search(model, capacity)
        assert best.n_selective == best.n_checkpoint == 0, capacity


def test_selective_loses_where_its_recompute_is_dear():
    """Selective blocks that recompute more than a whole forward and keep most of their activations: the search
    checkpoints (or swaps) instead, under the same tight capacity where cheap selective blocks win."""
    model = selective(synthetic(n_block=8, n_chunk=6), kept=0.7, recompute=1.5)
    capacity = capacities(selective(model, kept=0.3, recompute=0.05))[2]
    (best, _, _), _ = search(model, capacity)
    assert best.n_selective == 0 and best.n_checkpoint + best.n_swap > 0
    assert rank(brute_force(model, capacity), capacity)[0][0] == best


def test_a_selective_block_is_priced_from_its_marks():
    """A profile whose forward nodes say what a selective block keeps and recomputes (profiler/selective.py):
    the block keeps the kept bytes, recomputes the marked nodes' time, spikes by their largest intra-op delta; a
    profile without marks prices no selective block, and the search never tries one."""

    def node(name, graph, block, seconds, saved=0, kept=0, recomputed=False, intra=0):
        return NodeProfile(
            name, "aten.mm.default" if kept else "aten.gelu.default", graph, "block", block, seconds, 0, intra, 0, 0,
            saved_for_backward=bool(saved), saved_bytes=saved, kept_bytes=kept, recomputed=recomputed,
        )  # fmt: skip

    nodes = [
        n
        for b in (0, 1)
        for n in (
            node(f"mm{b}", "forward", b, 0.003, saved=0, kept=400),
            node(f"gelu{b}", "forward", b, 0.001, saved=1000, recomputed=True, intra=1000),
            node(f"out{b}", "forward", b, 0.0005, saved=100, kept=100),
            node(f"bw{b}", "backward", b, 0.008),
        )
    ]
    profile = GraphProfile("cuda", 0.009, 0.016, 0, 0, 2200, nodes, aggregate_blocks(nodes))
    hardware = synthetic().hardware
    model = CostModel.build(profile, hardware, n_block=2)
    assert model.prices_selective
    assert model.block_kept == (500, 500) and model.block_saved == (1100, 1100)
    assert model.block_selective_s == pytest.approx((0.001, 0.001)) and model.block_selective_transient == (1000,) * 2
    assert model.saving(0, "selective") == 600 and model.recompute_s(0, "selective") == pytest.approx(0.001)
    none, one = model.phases(Candidate()), model.phases(Candidate(n_selective=1))
    assert one["backward_s"] - none["backward_s"] == pytest.approx(0.001)
    unmarked = [dataclasses.replace(n, kept_bytes=0, recomputed=False) for n in nodes]
    plain = CostModel.build(dataclasses.replace(profile, nodes=unmarked), hardware, n_block=2)
    assert not plain.prices_selective and plain.saving(0, "selective") == 0
    assert all(c.n_selective == 0 for c, _, _ in brute_force(plain, None))


def test_memory_and_time_of_a_selective_block():
    """A selective block holds its saved bytes less those it keeps from the block after it in the forward until
    the backward reaches it, where its recompute spikes; its backward recomputes its marked ops."""
    model = selective(synthetic(n_chunk=4), kept=0.25, recompute=0.1)
    n = model.n_block
    none = model.activation_peak(("none",) * n)
    first = ("selective",) + ("none",) * (n - 1)
    assert none - model.activation_peak(first) == model.block_saved[0] - model.block_kept[0]
    layout = model.modes(Candidate(n_persist=4, n_selective=3, n_checkpoint=2))
    assert layout == ("checkpoint",) * 2 + ("selective",) * 3 + ("none",) * (n - 5)
    extra = sum(model.block_selective_s[2:5]) + sum(model.block_fwd_s[:2])
    base, mixed = (
        model.phases(Candidate(n_persist=4)),
        model.phases(Candidate(n_persist=4, n_checkpoint=2, n_selective=3)),
    )
    assert mixed["backward_s"] - base["backward_s"] == pytest.approx(extra)
    assert mixed["forward_s"] == pytest.approx(base["forward_s"])


@pytest.mark.parametrize(
    "variant", ["overlapping", "cpu", "two-ranks", "noisy-link", "host-bound", "link-slow-by-host"]
)
def test_floor_and_bound_never_exceed_the_step(variant):
    """`step_floor_s` <= `step_bound_s` <= `step_s` for every configuration, selective or not, with the host as
    profiled and HOST_SLOWDOWN times slower and a step whose clip applies, weighted as the search ranks by them:
    on a GPU (copies overlap), on the CPU (nothing overlaps), across two ranks, with a link measured faster beside
    other work than alone, with a slow host, with a link ten times slower beside the host's AdamW; and with
    `clip_weight=1.0` under the clipped step alone, which is not always the longer step (its copies run beside no
    host work: here it is the shorter for some on the CPU, across two ranks and with that link)."""
    model = {
        "overlapping": synthetic(n_block=8, n_chunk=6),
        "cpu": dataclasses.replace(synthetic(n_block=8, n_chunk=6), overlap=False),
        "two-ranks": on_two_ranks(0.002, stretch=2.0, delay=0.5),
        "noisy-link": linked(synthetic(n_block=8, n_chunk=6), rate=40e9, h2d_concurrent=60e9, both_beside_host=80e9),
        "host-bound": beside_matmuls(synthetic(n_block=8, n_chunk=6), 0.3),
        "link-slow-by-host": linked(synthetic(n_block=8, n_chunk=6), h2d_beside_host=5e9, both_beside_host=3e9),
    }[variant]
    if variant == "host-bound":
        model = dataclasses.replace(model, hardware=model.hardware.host_slower(5.0))
    model = selective(model, kept=0.3, recompute=0.2)
    ranked = ranked_step_s(model)
    weighed, ulp = {"host_scales": (1.0, HOST_SLOWDOWN), "clip_weight": CLIP_WEIGHT}, 1 + 1e-12  # (rounding)
    shorter_clipped = 0
    for config, _, _ in brute_force(model, None):
        terms = model.mode_terms(config)
        floor, bound = (f(config, terms, **weighed) for f in (model.step_floor_s, model.step_bound_s))
        assert floor <= bound * ulp and bound <= ranked(config) * ulp, config
        floor, bound, step = model.step_floor_s(config), model.step_bound_s(config), model.step_s(config)
        assert floor <= bound * ulp and bound <= step * ulp, config
        clipped = model.step_s(config, clipped=0)
        floor, bound = (f(config, terms, clip_weight=1.0) for f in (model.step_floor_s, model.step_bound_s))
        assert floor <= bound * ulp and bound <= clipped * ulp, config
        shorter_clipped += clipped < step
    if variant in ("cpu", "two-ranks", "link-slow-by-host"):  # (so the unclipped step is no bound of the clipped one)
        assert shorter_clipped


def test_the_search_times_few_of_the_selective_space(monkeypatch):
    """With selective blocks the space is a block count larger; the floors and bounds keep the timed ones few."""
    model = selective(synthetic(n_block=10, n_chunk=6), kept=0.3, recompute=0.1)
    configs, capacity = [c for c, _, _ in brute_force(model, None)], capacities(model)[3]
    timed = []
    step_s = CostModel.step_s
    monkeypatch.setattr(
        CostModel, "step_s", lambda self, config, clipped=None: timed.append(config) or step_s(self, config, clipped)
    )
    search(model, capacity)
    assert len(configs) > 5 * len(timed) > 0


def test_a_forced_selective_layout_is_planned_with_its_price():
    """A forced block_modes list with selective blocks: the plan holds it, and predicts its recompute and its
    saving."""
    model = selective(synthetic(n_block=4, n_chunk=4), kept=0.3, recompute=0.1)
    layout = ChunkLayout(chunk_elems=model.chunk_elems, element_size=2, world_size=1, slots=(), n_chunk=4)
    modes = ["selective", "none", "selective", "checkpoint"]
    plan = plan_graph(model, {"block_modes": modes, "n_persist": 4}, layout, None)
    assert plan.block_modes == tuple(modes) and (plan.n_selective, plan.n_checkpoint) == (2, 1)
    forced = dataclasses.replace(model, forced_modes=tuple(modes))
    config = Candidate(n_persist=4, n_checkpoint=1, n_selective=2)
    assert plan.predicted_step_s == pytest.approx(forced.step_s(config))
    assert plan.predicted_peak_bytes == forced.peak_bytes(config) < model.peak_bytes(Candidate(n_persist=4))
