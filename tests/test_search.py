"""The cost models and the search (planner/cost.py, planner/search.py) on synthetic profiles with GPU-like
hardware figures, where every choice has a price: the search returns the brute-force optimum, respects the
capacity and the forced fields, and reacts to capacity as the paper's Table "Automatically searched
configurations" does; and a real tiny model gets the everything-on-the-GPU plan when memory is plenty."""

import dataclasses

import models
import pytest
import torch
from cost_models import H100_LIKE, GiB, beside_matmuls, capacities, linked, on_two_ranks, synthetic

import protrain_fx
from protrain_fx.planner.chunking import ChunkLayout
from protrain_fx.planner.cost import Candidate, CostModel
from protrain_fx.planner.link import HostRates, Link
from protrain_fx.planner.plan import HOST_STATES, MIN_GRAD_SLOTS
from protrain_fx.planner.search import (
    CLIP_WEIGHT,
    CPU_TIE_REL,
    HOST_SLOWDOWN,
    MAX_TIE_REL,
    SAFE_HEADROOM,
    TIE_REL,
    NoPlanFits,
    _ByModes,
    brute_force,
    candidates,
    plan_graph,
    rank,
    ranked_step_s,
    search,
    slow_host,
    tie_rel,
)
from protrain_fx.profiler.hardware import HardwareProfile


@pytest.mark.parametrize("seed", range(4))
def test_search_finds_the_brute_force_optimum(seed):
    """Pruning (n_persist rows cut at the first plan over capacity, swap count bounded, configurations timed only
    while their step time's lower bound can still place them) never changes the optimum nor its runners-up."""
    model = synthetic(seed=seed, n_block=6 + seed, n_chunk=4 + seed)
    for capacity in capacities(model):
        best, runners_up = search(model, capacity)
        expected, expected_runners_up = rank(brute_force(model, capacity), capacity, alpha=model.alpha)
        assert best == expected, capacity
        assert runners_up == expected_runners_up, capacity
        assert best[2] <= capacity and all(r[2] <= capacity for r in runners_up)
        assert all(r[1] * (1 + TIE_REL) >= best[1] for r in runners_up)  # (ties go to the least rewritten)


@pytest.mark.parametrize("seconds", [0.0005, 0.02])
def test_search_with_chunks_sharded_on_the_device_finds_the_brute_force_optimum(seconds):
    """Two ranks, whose chunks' collectives take `seconds`: each chunk persistent, sharded on the device or
    offloaded. The search tries no chunk and the most that fit sharded on the device for every layout, then every
    count for the layouts that win; brute force tries every count everywhere: the same best, from a GPU that holds
    little to one that holds every chunk, with the host budgeted or not."""
    model = on_two_ranks(seconds)
    for capacity in capacities(model)[1::2]:
        for host in (None, 2 * GiB):
            fits = brute_force(model, capacity, host_bytes=host)
            if not fits:
                continue
            best, runners_up = search(model, capacity, host_bytes=host)
            assert best == rank(fits, capacity, alpha=model.alpha)[0], (capacity, host)
            assert all(r[1] >= best[1] * (1 - TIE_REL) for r in runners_up)


def test_chunks_go_to_the_gpus_where_together_they_hold_them_and_the_host_cannot():
    """Two ranks, a GPU too small for every chunk whole and a host with no room for any: the chunks not persistent
    are sharded across the GPUs, which together hold them; held on the host alone, no plan fits, and the error says
    what sharding them on the GPUs gives."""
    model = on_two_ranks(0.002)
    capacity, host = capacities(model)[3], 1
    layout = ChunkLayout(chunk_elems=model.chunk_elems, element_size=2, world_size=2, slots=(), n_chunk=model.n_chunk)
    plan = plan_graph(model, {}, layout, capacity, host)
    assert plan.n_persist < model.n_chunk and plan.n_device_shard == model.n_chunk - plan.n_persist
    assert plan.predicted_reserved_bytes <= capacity and model.host_bytes(Candidate.of(plan)) == 0
    with pytest.raises(NoPlanFits, match="with n_device_shard searched instead, the search plans n_persist="):
        plan_graph(model, {"n_device_shard": 0}, layout, capacity, host)


def test_step_bound_is_a_lower_bound_and_spares_most_timings(monkeypatch):
    """`step_bound_s` never exceeds `step_s`, also where the profile measured a copy faster beside other work than
    alone (noise: no copy is faster for company); the search times only the configurations it can still use."""
    model = linked(synthetic(n_block=10, n_chunk=6), rate=40e9, h2d_concurrent=60e9, both_beside_host=80e9)
    configs = [c for c, _, _ in brute_force(model, None)]
    for config in configs:
        assert model.step_bound_s(config) <= model.step_s(config) * (1 + 1e-12), config
    timed = []
    step_s = CostModel.step_s
    monkeypatch.setattr(
        CostModel, "step_s", lambda self, config, clipped=None: timed.append(config) or step_s(self, config, clipped)
    )
    search(model, None)
    assert len(configs) > 10 * len(timed) > 0


def test_search_reacts_to_capacity():
    """Plenty of memory: every chunk on the GPU, no block recomputed or swapped; less memory: fewer persistent
    chunks and more blocks checkpointed or swapped (paper Table "Automatically searched configurations")."""
    model = synthetic()
    plans = [search(model, capacity)[0][0] for capacity in reversed(capacities(model))]
    roomy, tight = plans[0], plans[-1]
    assert roomy == Candidate(model.n_chunk, 0, 0, 0)
    assert tight.n_persist < model.n_chunk and tight.n_checkpoint + tight.n_swap > 0
    persist = [p.n_persist for p in plans]
    assert persist == sorted(persist, reverse=True)


def test_ties_go_to_the_least_rewritten_plan_with_headroom_to_spare():
    """Equal predicted times (a swap hidden behind compute is priced at nothing): with SAFE_HEADROOM to spare the
    plan that rewrites least wins; when only the swapping one leaves it, that one; when none does, the lowest
    peak."""
    plain, swapped = (Candidate(4, 0, 0, 0), 1.0, 50), (Candidate(4, 0, 1, 0), 1.0 + TIE_REL / 2, 40)
    slower = (Candidate(4, 0, 0, 1), 1.1, 30)
    fits = [swapped, slower, plain]
    assert rank(fits, 100)[0] == plain
    assert rank(fits, None)[0] == plain
    assert rank(fits, int(50 / (1 - SAFE_HEADROOM)) - 1)[0] == swapped
    assert rank(fits, 42)[0] == swapped  # (neither leaves SAFE_HEADROOM: the lower peak)
    assert rank(fits, 100)[1] == [swapped, slower]
    assert rank(fits, 100, alpha=2.0)[0] == swapped  # (headroom is of the reserved bytes: peak times alpha)


def test_ties_are_within_the_profiles_timing_noise():
    """Step times tie within the profile's timing noise, at least TIE_REL (CPU_TIE_REL on the CPU, whose speed
    against its hardware profile moves between profiles by more than one profile's runs show) and at most
    MAX_TIE_REL; a plan that rewrites less wins where it is within that noise of the fastest, and the search
    agrees with brute force ranked alike."""
    model = synthetic()
    assert tie_rel(model) == TIE_REL
    assert tie_rel(dataclasses.replace(model, timing_noise=0.02)) == 0.02
    assert tie_rel(dataclasses.replace(model, timing_noise=0.5)) == MAX_TIE_REL
    assert tie_rel(dataclasses.replace(model, overlap=False)) == CPU_TIE_REL
    plain, checkpointed = (Candidate(4, 0, 0, 0), 1.015, 50), (Candidate(4, 0, 0, 1), 1.0, 40)
    assert rank([plain, checkpointed], 100, tie=TIE_REL)[0] == checkpointed
    assert rank([plain, checkpointed], 100, tie=0.02)[0] == plain
    noisy = dataclasses.replace(model, timing_noise=0.03)
    for capacity in capacities(noisy):
        best, runners_up = search(noisy, capacity)
        assert (best, runners_up) == rank(brute_force(noisy, capacity), capacity, alpha=noisy.alpha, tie=0.03)
        assert all(best[1] <= r[1] * 1.03 for r in runners_up)


def test_plans_are_ranked_also_with_a_slower_host():
    """The search ranks by the mean of each plan's step time at the profiled host rate and at HOST_SLOWDOWN times
    it: here the plan fastest at the profiled rate has the slower host hold its next forward up, and loses to
    one that is a little slower at the profiled rate and less so beside a slower host. The plan predicts the
    profiled host's step time, and gives the slower host's beside it."""
    model = synthetic(seed=1)
    capacity = capacities(model)[3]
    slow = slow_host(model)
    fastest = min(brute_force(model, capacity), key=lambda f: model.step_s(f[0]))[0]  # at the profiled rate
    layout = ChunkLayout(chunk_elems=model.chunk_elems, element_size=2, world_size=1, slots=(), n_chunk=model.n_chunk)
    plan = plan_graph(model, {}, layout, capacity)
    best = Candidate(plan.n_persist, plan.n_buffer, plan.n_swap, plan.n_checkpoint)
    assert best != fastest
    assert model.step_s(fastest) < model.step_s(best) < model.step_s(fastest) * 1.05
    assert slow.step_s(best) < slow.step_s(fastest)
    assert plan.predicted_step_s == pytest.approx(model.step_s(best))
    assert plan.predicted_slow_host_step_s == pytest.approx(slow.step_s(best))
    assert slow.hardware.host_adam_s(True, True) == pytest.approx(
        HOST_SLOWDOWN * model.hardware.host_adam_s(True, True)
    )


def _clip_sensitive() -> CostModel:
    """Ten chunks whose device AdamW the backward nearly hides, over a fast link: offloading the last two saves a
    little of it and their host updates hide behind the backward, unless a clip applies and they wait for
    `optimizer.step()`."""
    model = linked(synthetic(n_chunk=10, block_saved=GiB // 8), rate=1e12)
    return beside_matmuls(model, 0.95)


def test_a_plan_far_slower_when_the_clip_applies_loses():
    """Offloading two chunks is predicted a hair (under TIE_REL) faster unclipped, but a fifth slower where the clip
    applies (every update waits for `optimizer.step()`), as on an H200 where Hugging Face's Trainer clipped every
    step: the search keeps every chunk on the device. The capacity leaves the all-persistent plan under
    SAFE_HEADROOM free, so a tie would go to the offloaded plan's lower peak: it must win on time. Its plan still
    predicts the unclipped step."""
    model = _clip_sensitive()
    persistent, offloaded = Candidate(10, 0), Candidate(8, 2)
    assert 0 < 1 - model.step_s(offloaded) / model.step_s(persistent) < TIE_REL
    assert model.step_s(offloaded, clipped=0) > 1.15 * model.step_s(persistent, clipped=0)
    capacity = int(model.reserved_bytes(persistent) / (1 - SAFE_HEADROOM / 2))
    assert model.reserved_bytes(offloaded) <= (1 - SAFE_HEADROOM) * capacity < model.reserved_bytes(persistent)
    activations = {"n_swap": 0, "n_checkpoint": 0}  # (the offload choice alone: a hidden swap would tie)
    (best, ranked, _), _ = search(model, capacity, activations)
    assert best == persistent
    assert ranked == pytest.approx(
        (1 - CLIP_WEIGHT) * (model.step_s(best) + slow_host(model).step_s(best)) / 2
        + CLIP_WEIGHT * model.step_s(best, clipped=0)
    )
    layout = ChunkLayout(chunk_elems=model.chunk_elems, element_size=2, world_size=1, slots=(), n_chunk=model.n_chunk)
    plan = plan_graph(model, activations, layout, capacity)
    assert plan.n_persist == 10 and plan.predicted_step_s == pytest.approx(model.step_s(persistent))


def test_where_memory_forces_offloading_the_search_still_offloads():
    """The same model with no room for every chunk on the GPU: the search offloads (however slow a clipped step
    then is) and fits."""
    model = _clip_sensitive()
    capacity = model.reserved_bytes(Candidate(10, 0)) - 1
    (best, _, peak), runners_up = search(model, capacity, {"n_swap": 0, "n_checkpoint": 0})
    assert best == Candidate(8, 2) and model.reserved_bytes(best, peak) <= capacity
    assert all(model.reserved_bytes(r[0], r[2]) <= capacity for r in runners_up)


def test_forced_fields_are_kept():
    model = synthetic()
    capacity = capacities(model)[3]
    best, _ = search(model, capacity, {"n_persist": 2, "n_checkpoint": 3})
    assert best[0].n_persist == 2 and best[0].n_checkpoint == 3
    plan = plan_graph(model, {"n_swap": 1}, None, capacity)
    assert plan.n_swap == 1 and plan.predicted_peak_bytes <= capacity and len(plan.runners_up) == 3


def test_no_configuration_has_fewer_buffers_than_the_graphs_hold():
    """Where the graphs hold more chunks at once than the search's least count (layers sharing weights, a model's
    own activation checkpointing: passes/chunks.py `buffers_needed`), no configuration has fewer buffers, so
    buffers above MAX_BUFFER are searched; with n_buffer forced, n_persist is searched among those it runs; with
    both forced the configuration is kept (the chunk pass says what the graph needs)."""
    needs = (6, 5, 3, 2, 1, 1, 0)  # the synthetic model's 6 chunks
    model = dataclasses.replace(synthetic(), least_buffers=needs)
    configs = [c for row in candidates(model, {}) for c in row]
    assert all(c.n_buffer >= needs[c.n_persist] for c in configs)
    assert {c.n_buffer for c in configs if c.n_persist == 0} == {6}
    assert {c.n_persist for row in candidates(model, {"n_buffer": 3}) for c in row} == {2, 3, 4, 5, 6}
    assert [c for row in candidates(model, {"n_buffer": 2, "n_persist": 1}) for c in row][0].n_buffer == 2
    best, _ = search(model, capacities(model)[2])
    assert best[0].n_buffer >= needs[best[0].n_persist]


def test_nothing_fits_says_what_is_needed():
    model = synthetic()
    least = min(model.peak_bytes(c) for c, _, _ in brute_force(model, None))
    with pytest.raises(NoPlanFits, match=r"(?s)needs .* GiB.*smaller batch.*more GPUs") as err:
        search(model, least - 1)
    assert err.value.peak_bytes == least


@pytest.mark.parametrize("seed", range(3))
def test_search_under_host_memory_finds_the_brute_force_optimum(seed):
    """With the host budgeted too, the search agrees with brute force, and every plan it returns fits both; the
    less host memory, the more chunks stay on the GPU (all it can hold, with the least)."""
    model = synthetic(seed=seed, n_block=6 + seed, n_chunk=4 + seed)
    capacity = capacities(model)[3]
    # of plans fitting the GPU: the least host memory each trains in
    needs = sorted({model.least_host_bytes(c) for c, _, _ in brute_force(model, capacity)})
    persisted = []
    for host in (None, needs[-1], needs[len(needs) // 2], needs[0]):
        best, runners_up = search(model, capacity, host_bytes=host)
        expected, _ = rank(brute_force(model, capacity, host_bytes=host), capacity, alpha=model.alpha)
        assert best == expected, host
        budgeted = dataclasses.replace(model, host_budget=host)  # with the gradient shards the host has room for
        assert host is None or all(budgeted.host_bytes(f[0]) <= host for f in (best, *runners_up))
        persisted.append(best[0].n_persist)
    assert persisted == sorted(persisted), persisted
    assert persisted[-1] == max(c.n_persist for c, _, _ in brute_force(model, capacity))


def test_nothing_fits_the_host_says_what_is_needed():
    """Plans that fit the GPU but whose offloaded chunks do not fit the host: an error with the host bytes the
    least of them needs and what to do, not the GPU's."""
    model = synthetic()
    capacity = capacities(model)[1]  # little GPU memory: most chunks must be offloaded
    fits_gpu = [c for c, _, _ in brute_force(model, capacity)]
    least = min(model.least_host_bytes(c) for c in fits_gpu)
    with pytest.raises(
        NoPlanFits, match=r"(?s)no plan fits the host memory: .* need at least .* GiB.*more GPUs"
    ) as err:
        search(model, capacity, host_bytes=least - 1)
    assert err.value.host_needed == least and err.value.host_bytes == least - 1
    assert search(model, capacity, host_bytes=least)[0][0] in fits_gpu


def test_host_memory_of_a_configuration():
    """Per offloaded chunk its shard's master and AdamW states (12 bytes an element) and, where the host has
    room, a gradient shard (4 bytes an element), else as many as it has room for, at least two, shared; a
    swapped block its saved activations."""
    model = synthetic(n_chunk=5)
    shard = model.shard_elems
    assert HOST_STATES == 3 and MIN_GRAD_SLOTS == 2
    offloaded = Candidate(1, 2, 0, 0)  # four offloaded chunks
    assert model.host_bytes(Candidate(5, 0, 0, 0)) == 0 and model.host_bytes(offloaded) == 4 * 16 * shard
    assert model.grad_slots(offloaded) == 4 and model.least_host_bytes(offloaded) == 4 * 12 * shard + 2 * 4 * shard
    for budget, slots in [(4 * 16 * shard, 4), (4 * 16 * shard - 1, 3), (4 * 12 * shard + 8 * shard, 2), (0, 2)]:
        budgeted = dataclasses.replace(model, host_budget=budget)
        assert budgeted.grad_slots(offloaded) == slots, budget
        assert budgeted.host_bytes(offloaded) == 4 * 12 * shard + slots * 4 * shard
    assert dataclasses.replace(model, host_budget=0).grad_slots(Candidate(4, 1, 0, 0)) == 1  # (one chunk: its own)
    own = dataclasses.replace(model, master_bytes=2)  # bfloat16 masters: the parameters themselves
    assert own.host_bytes(offloaded) == 4 * 8 * shard
    swapped = Candidate(5, 0, 1, 0)
    assert model.host_bytes(swapped) == sum(
        model.block_saved[b] for b, m in enumerate(model.modes(swapped)) if m == "swap"
    )


def test_memory_model_terms():
    """Checkpointing or swapping a block takes its saved bytes (a checkpointed one keeps its output) off every
    point between its forward and its backward; chunk states count 18 bytes per persistent element."""
    model = synthetic(n_chunk=4)
    none = model.activation_peak(("none",) * model.n_block)
    first = ("checkpoint",) + ("none",) * (model.n_block - 1)
    assert none - model.activation_peak(first) == model.block_saved[0] - model.block_output[0]
    swapped = ("swap",) + ("none",) * (model.n_block - 1)
    assert none - model.activation_peak(swapped) == model.block_saved[0]
    elems = model.chunk_elems
    assert model.state_bytes(Candidate(4, 0, 0, 0)) == 4 * elems * (2 + 4 + 4 + 8)
    # + the landing shard and the reduce buffer of the one offloaded chunk
    assert model.state_bytes(Candidate(3, 2, 0, 0)) == 3 * elems * 18 + 2 * elems * 2 + elems * 4 + elems * 4
    assert model.state_bytes(Candidate(1, 2, 0, 0)) == elems * 18 + 2 * elems * 2 + elems * 4 + 2 * elems * 4
    # bfloat16 masters: the parameters are their own, gradients and states are bfloat16 (8 bytes an element), and
    # offloaded shards land straight in their buffer
    own = dataclasses.replace(model, master_bytes=2)
    assert own.state_bytes(Candidate(4, 0, 0, 0)) == 4 * elems * (2 + 2 + 4)
    assert own.state_bytes(Candidate(1, 2, 0, 0)) == elems * 8 + 2 * elems * 2 + 2 * elems * 2


def test_bfloat16_masters_fit_more_chunks_and_update_faster():
    """Where fp32 masters fit at most three of six chunks on the GPU, bfloat16 ones fit them all; their AdamW, measured
    or (not measured) in proportion to the bytes, takes half the time."""
    model = synthetic(n_chunk=6, block_saved=GiB // 8)
    own = dataclasses.replace(model, master_bytes=2)
    capacity = model.reserved_bytes(Candidate(3, 2, 0, 0))
    assert own.reserved_bytes(Candidate(6, 0, 0, 0)) <= capacity < model.reserved_bytes(Candidate(4, 2, 0, 0))
    assert max(c.n_persist for c, _, _ in brute_force(model, capacity)) == 3
    assert max(c.n_persist for c, _, _ in brute_force(own, capacity)) == 6
    hw = model.hardware
    assert hw.device_adam_s(2) == hw.device_adam_s_per_param / 2 and hw.host_adam_s(True, True, 2) == 1e-10
    measured = dataclasses.replace(hw, device_adam_bf16_s_per_param=3e-11, host_adam_bf16_s_per_param=1.5e-10)
    assert measured.device_adam_s(2) == 3e-11 and measured.host_adam_s(True, False, 2) == pytest.approx(1.5e-10)


def test_gradient_copies_slower_than_the_backward_hold_it_up():
    """Offloaded chunks reduce their gradients in two fp32 buffers in turn (runtime/chunks/reduce.py) and copy them to
    the host one at a time: the memory is the two buffers whatever the link, and a link slower than the
    backward makes each reduce wait for the copy out of the buffer it reuses, and the host's AdamW for its
    gradients."""
    model = synthetic(n_chunk=4)
    config = Candidate(n_persist=1, n_buffer=2)

    def with_link(bytes_per_s):
        link = {"d2h_bytes_per_s": bytes_per_s, "d2h_concurrent_bytes_per_s": bytes_per_s}
        return dataclasses.replace(model, hardware=dataclasses.replace(H100_LIKE, **link))

    fast, slow = with_link(1e15), with_link(1e9)
    assert slow.peak_bytes(config) == fast.peak_bytes(config)
    copy_s = model.shard_elems * 4 / 1e9
    # three offloaded chunks: the third reduce waits for the first copy; the last copy ends after the compute
    assert slow.phases(config)["backward_s"] > fast.phases(config)["backward_s"] + copy_s / 2
    assert slow.step_s(config) > fast.step_s(config)


def test_shared_gradient_shards_hold_the_backward_up_where_the_host_is_slower():
    """Where the offloaded chunks share fewer host gradient shards than there are of them, a chunk's gradient
    waits for one to be given back by a host update, and the backward with it: with a host slower than the
    backward the step takes longer and the backward waits; with a fast host nothing changes. The search on a
    budget prices that."""
    model = synthetic(n_chunk=6)
    config = Candidate(n_persist=1, n_buffer=2)  # five offloaded chunks

    def host(s_per_param: float, slots: int | None) -> CostModel:
        rates = {f: s_per_param for f in ("host_adam", "host_adam_h2d", "host_adam_d2h", "host_adam_both")}
        hardware = dataclasses.replace(H100_LIKE, **{f"{k}_s_per_param": v for k, v in rates.items()})
        return dataclasses.replace(model, hardware=hardware, forced_grad_slots=slots)

    slow_each, slow_shared = host(2e-9, None), host(2e-9, 2)
    assert slow_each.grad_slots(config) == 5 and slow_shared.grad_slots(config) == 2
    waited = slow_shared.phases(config)["backward_s"] - slow_each.phases(config)["backward_s"]
    assert waited > 0.5 * model.chunk_params[-1] * 2e-9  # (at least half a host update)
    assert slow_shared.step_s(config) > slow_each.step_s(config)
    fast_each, fast_shared = host(1e-13, None), host(1e-13, 2)
    assert fast_shared.step_s(config) == pytest.approx(fast_each.step_s(config), rel=1e-9)
    assert slow_shared.step_bound_s(config) <= slow_shared.step_s(config)
    # a budget with room for two shards only: the plan says so, and its time is that of two shards; a forced
    # n_persist is not budgeted (one shard each) unless the shards are forced too
    layout = ChunkLayout(chunk_elems=model.chunk_elems, element_size=2, world_size=1, slots=(), n_chunk=model.n_chunk)
    budget = slow_each.least_host_bytes(config)
    capacity = slow_each.reserved_bytes(config)  # no more chunks on the GPU; no fewer on this host
    plan = plan_graph(slow_each, {"n_buffer": 2, "n_swap": 0, "n_checkpoint": 0}, layout, capacity, budget)
    assert (plan.n_persist, plan.host_grad_slots) == (1, 2), plan
    assert plan.predicted_step_s == pytest.approx(slow_shared.step_s(config))
    forced = {"n_persist": 1, "n_buffer": 2, "n_swap": 0, "n_checkpoint": 0}
    assert plan_graph(slow_each, forced, layout, None, budget).host_grad_slots == 5
    shared = plan_graph(slow_each, {**forced, "host_grad_slots": 2}, layout, None)
    assert shared.host_grad_slots == 2 and shared.predicted_step_s == pytest.approx(slow_shared.step_s(config))
    assert plan_graph(slow_each, {**forced, "host_grad_slots": 6}, layout, None).host_grad_slots == 5  # one each
    with pytest.raises(ValueError, match=r"host_grad_slots'\] must be at least 1"):
        plan_graph(slow_each, {**forced, "host_grad_slots": 0}, layout, None)


def test_persistent_chunks_share_device_gradient_buffers_only_where_nothing_else_fits():
    """With a GPU and a host too small for any plan whose persistent chunks have an fp32 gradient each, the
    persistent chunks share MIN_GRAD_SLOTS (the search's last resort): the GPU then holds one chunk more and the
    host one fewer, also where the parameters are their own master (a float32 model, or bfloat16 masters). Where
    a plan fits without, or the user forces the count, there is no last resort."""
    model = synthetic(n_chunk=6)
    sharing = dataclasses.replace(model, share_device_grads=True)
    config = Candidate(n_persist=4, n_buffer=2)
    assert (model.device_grad_slots(config), sharing.device_grad_slots(config)) == (4, MIN_GRAD_SLOTS)
    assert model.state_bytes(config) - sharing.state_bytes(config) == 2 * model.chunk_elems * 4
    layout = ChunkLayout(chunk_elems=model.chunk_elems, element_size=2, world_size=1, slots=(), n_chunk=model.n_chunk)
    forced = {"n_buffer": 2, "n_swap": 0, "n_checkpoint": 0}
    host = model.least_host_bytes(config)  # four chunks on the GPU at least
    capacity = sharing.reserved_bytes(config)  # which fit it only sharing two gradient buffers
    assert model.reserved_bytes(config) > capacity
    plan = plan_graph(model, forced, layout, capacity, host)
    assert (plan.n_persist, plan.device_grad_slots) == (4, MIN_GRAD_SLOTS), plan
    assert plan.predicted_peak_bytes == sharing.peak_bytes(config)
    roomy = plan_graph(model, forced, layout, model.reserved_bytes(config), host)
    assert (roomy.n_persist, roomy.device_grad_slots) == (4, 4), roomy
    fp32 = dataclasses.replace(model, element_size=4)  # a float32 model: the parameters are their own master
    fp32_layout = dataclasses.replace(layout, element_size=4)
    plan = plan_graph(fp32, forced, fp32_layout, fp32.reserved_bytes(config) - 2 * model.chunk_elems * 4, host)
    assert (plan.n_persist, plan.device_grad_slots) == (4, MIN_GRAD_SLOTS), plan
    own = dataclasses.replace(model, master_bytes=2)  # bfloat16 masters: the parameters' own
    own_sharing = dataclasses.replace(own, share_device_grads=True)
    bf16 = {**forced, "master_dtype": "bfloat16"}
    plan = plan_graph(own, bf16, layout, own_sharing.reserved_bytes(config), own.least_host_bytes(config))
    assert (plan.n_persist, plan.device_grad_slots) == (4, MIN_GRAD_SLOTS), plan
    with pytest.raises(NoPlanFits):
        plan_graph(model, {**forced, "device_grad_slots": 4}, layout, capacity, host)
    persist = {**forced, "n_persist": 4}
    assert plan_graph(model, {**persist, "device_grad_slots": 1}, layout, None).device_grad_slots == 1
    assert plan_graph(model, {**persist, "device_grad_slots": 9}, layout, None).device_grad_slots == 4  # one each
    with pytest.raises(ValueError, match=r"device_grad_slots'\] must be at least 1 where chunks are persistent"):
        plan_graph(model, {**persist, "device_grad_slots": 0}, layout, None)


def test_uploads_run_ahead_as_far_as_the_buffers_allow():
    """The runtime reaches a chunk's gather ahead of the device, so a chunk uploads as soon as the link and a
    buffer are free: with a buffer per offloaded chunk every upload runs beside the persistent chunks' compute;
    with one buffer only the first does, and each later one waits for the chunk before it to be computed."""
    model = linked(synthetic(n_chunk=6), rate=1e9)
    load = model.shard_elems * 4 / 1e9  # > any chunk's compute
    per = model._per_chunk(Candidate(n_persist=3, n_buffer=3))
    persistent, offloaded = sum(per["forward"][:3]), per["forward"][3:]
    many = model.phases(Candidate(n_persist=3, n_buffer=3))["forward_s"]
    one = model.phases(Candidate(n_persist=3, n_buffer=1))["forward_s"]
    assert many == pytest.approx(max(persistent, 3 * load) + offloaded[-1])
    assert one == pytest.approx(max(persistent, load) + sum(offloaded) + 2 * load)


def test_a_chunk_gathered_again_is_uploaded_again_where_offloaded():
    """A tied embedding's chunk (0), read again by the head beside the last chunk's compute (`regathers`):
    offloaded, the forward uploads it a second time as that compute starts, and the compute (the head's) ends no
    sooner than that upload; persistent, it costs nothing. The search then weighs keeping it on the device."""
    model = linked(dataclasses.replace(synthetic(n_chunk=6), regathers=((0, 5),)), rate=1e9)
    untied = dataclasses.replace(model, regathers=())
    load = model.shard_elems * 4 / 1e9  # > any chunk's compute
    offloaded, persistent = Candidate(n_persist=0, n_buffer=2), Candidate(n_persist=1, n_buffer=2)
    last = model._per_chunk(offloaded)["forward"][5]
    forward = model.phases(offloaded)["forward_s"]
    assert forward == pytest.approx(untied.phases(offloaded)["forward_s"] - last + load)
    assert model.step_s(offloaded) > untied.step_s(offloaded)
    assert model.step_s(persistent) == untied.step_s(persistent)


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_of_a_block_layouts_terms_is_the_configurations_with_a_chunk_gathered_again(seed):
    """The search hands each configuration the terms of its block layout, computed once, for the layout's first
    configuration (`_ByModes`). The chunks the forward gathers again depend on `n_persist`, not on the layout: the
    bound takes the configuration's own, so it never exceeds the step as ranked (with the layout's first, a tied
    embedding's chunk persistent in the configuration was priced as uploaded again, up to 6% over the step). The
    search then agrees with timing every configuration."""
    model = dataclasses.replace(synthetic(n_block=8, n_chunk=6, seed=seed), regathers=((0, 5),))
    by_modes, ranked = _ByModes(model), ranked_step_s(model)
    weighed = {"host_scales": (1.0, HOST_SLOWDOWN), "clip_weight": CLIP_WEIGHT}
    for row in candidates(model, {}):
        for config in row:
            assert model.step_bound_s(config, by_modes(config), **weighed) <= ranked(config) * (1 + 1e-12), config
    for capacity in capacities(model):
        best, _ = search(model, capacity)
        everything = rank(brute_force(model, capacity), capacity, alpha=model.alpha, tie=tie_rel(model))
        assert best[0] == everything[0][0], capacity


def test_copies_beside_the_host_optimizer_run_slower():
    """The host's AdamW shares the host's memory bandwidth with the link: an offloaded plan whose uploads run
    while the host steps earlier chunks takes longer where the profile measured the link slower beside it. A
    plan with nothing offloaded has no host work and does not change."""
    model = synthetic(n_chunk=6)
    offloaded, persistent = Candidate(n_persist=2, n_buffer=2), Candidate(n_persist=6, n_buffer=0)
    fast, slow = linked(model), linked(model, h2d_beside_host=1e9, both_beside_host=1e9)
    longer = slow.phases(offloaded)["backward_s"] - fast.phases(offloaded)["backward_s"]
    upload = model.shard_elems * 4 * (1 / 1e9 - 1 / 50e9)  # what one upload takes longer wholly beside the host
    assert 0.1 * upload < longer <= 2 * upload  # (the backward's 2 uploads, in part beside the host's AdamW)
    assert slow.step_s(persistent) == fast.step_s(persistent)


def test_persistent_updates_add_what_the_backward_does_not_hide():
    """Each persistent chunk's device AdamW starts once its gradient is reduced and runs beside the rest of the
    backward, which hides `hidden` of its time times the backward's matmul share (memory-bound kernels hide
    none); chunk 0's runs after the backward and adds all its time. A clipped step updates in `AdamW.step()`:
    all of it. Beside a short backward only what fits adds less."""
    model = synthetic(n_chunk=6)
    config = Candidate(n_persist=6, n_buffer=0)
    adam = [n * model.hardware.device_adam_s(model.master_bytes) for n in model.chunk_params]
    full = sum(adam)
    assert beside_matmuls(model, 0.0).phases(config)["gpu_optim_s"] == pytest.approx(full)  # nothing hidden
    assert beside_matmuls(model, 1.0).phases(config)["gpu_optim_s"] == pytest.approx(adam[0])  # all but chunk 0's
    assert beside_matmuls(model, 1.0, matmul_share=0.25).phases(config)["gpu_optim_s"] == pytest.approx(
        adam[0] + 0.75 * sum(adam[1:])
    )
    assert beside_matmuls(model, 0.8).phases(config, clipped=0)["gpu_optim_s"] == pytest.approx(full)
    # a backward with no compute: no update runs beside it
    short = dataclasses.replace(beside_matmuls(model, 1.0), block_bwd_s=(0.0,) * model.n_block, other_bwd_s=(0.0, 0.0))
    assert short.phases(config)["gpu_optim_s"] == pytest.approx(full)
    # where each update takes 20 times as long beside the backward, less of it runs before the backward ends
    slow, fast = beside_matmuls(model, 1.0, stretch=20.0), beside_matmuls(model, 1.0, stretch=1.0)
    assert fast.phases(config)["gpu_optim_s"] < slow.phases(config)["gpu_optim_s"] < full
    for hidden in (0.0, 0.5, 1.0):
        beside = beside_matmuls(model, hidden)
        for n_persist in range(model.n_chunk + 1):
            config = Candidate(n_persist, 0 if n_persist == model.n_chunk else 2)
            assert beside.step_bound_s(config) <= beside.step_s(config) * (1 + 1e-12), (hidden, config)


def test_collectives_hold_the_compute_up_as_the_runtime_runs_them():
    """An offloaded chunk's reduce-scatter holds the compute stream until it ends (runtime/chunks/reduce.py). A persistent
    chunk's all-reduce runs on its own stream beside the next chunk's backward, which it slows by its time there
    times the delay the profile measured (chunk 0's has no backward left beside it), and once landed costs two
    passes over the fp32 gradient on the compute stream, which one rank does not make. On two H200s the
    compute's kernels took 48 ms longer in a 5.5B step beside 89 ms of collectives (twenty-second session)."""
    fast, slow = on_two_ranks(0.0), on_two_ranks(0.002)
    offloaded, persistent = Candidate(n_persist=0, n_buffer=6), Candidate(n_persist=6, n_buffer=0)
    assert slow.phases(offloaded)["backward_s"] == pytest.approx(fast.phases(offloaded)["backward_s"] + 6 * 0.002)
    one_rank = synthetic(n_chunk=6).phases(persistent)["backward_s"]
    passes = 2 * 2 * fast.chunk_elems * 4 / fast.hardware.device_bytes_per_s  # (a pass reads and writes the chunk)
    assert slow.phases(persistent)["backward_s"] == pytest.approx(one_rank + 5 * passes)
    beside = on_two_ranks(0.002, stretch=2.0, delay=0.5).phases(persistent)["backward_s"]
    assert beside == pytest.approx(one_rank + 5 * (passes + 0.002 * 2.0 * 0.5))


def test_updates_that_wait_for_the_step_are_timed_as_a_clipped_step():
    """Where every update waits for `AdamW.step()` (loss scaling skips a step with an overflow), a step is timed
    as a clipped one none of whose offloaded chunks update during the backward: longer than one where they do."""
    model = beside_matmuls(synthetic(n_chunk=6), 0.5)
    waiting = dataclasses.replace(model, updates_wait=True)
    for config in (Candidate(6, 0), Candidate(3, 2)):
        assert waiting.step_s(config) == pytest.approx(model.step_s(config, clipped=0))
        assert waiting.step_s(config) > model.step_s(config)
        assert waiting.step_bound_s(config) <= waiting.step_s(config)


def test_hidden_persistent_updates_keep_more_chunks_on_the_device():
    """Where the backward hides the persistent chunks' device AdamW, offloading a chunk saves less than its
    host-side costs: the search keeps every chunk on the device. Where nothing is hidden, the same model offloads
    (the AdamW of a chunk on the host is free here, the link fast)."""
    model = linked(synthetic(n_chunk=6, block_saved=GiB // 8), rate=1e12)
    model = dataclasses.replace(model, hardware=dataclasses.replace(model.hardware, device_adam_s_per_param=4e-11))
    (exposed, _, _), _ = search(beside_matmuls(model, 0.0), None)
    (hidden, _, _), _ = search(beside_matmuls(model, 1.0), None)
    assert exposed.n_persist < model.n_chunk
    assert hidden.n_persist == model.n_chunk


def test_tiny_model_keeps_everything_on_the_device():
    """No capacity limit (the CPU): the searched plan of a real tiny model changes nothing, and carries its
    predictions and runners-up. Its backward spends part of its time in matmuls (the share beside which the
    device's AdamW can hide)."""
    model = models.build("llama", layers=4)
    protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    compiled(**models.batch("llama")).loss.backward()
    plan = backend.graphs[0].plan
    assert plan.n_persist == plan.n_chunk > 1 and plan.n_checkpoint == plan.n_swap == 0
    assert plan.predicted_step_s > 0 and plan.predicted_peak_bytes > 0 and plan.runners_up
    assert "predicted_peak_bytes" in str(plan)
    assert 0 < backend.graphs[0].costs.backward_matmul_share < 1


def _host_adam(idle: float, h2d: float, d2h: float, both: float) -> HardwareProfile:
    return dataclasses.replace(
        H100_LIKE,
        host_adam_s_per_param=idle,
        host_adam_h2d_s_per_param=h2d,
        host_adam_d2h_s_per_param=d2h,
        host_adam_both_s_per_param=both,
    )


def test_host_optimizer_rate_follows_the_copies_beside_it():
    """The host's AdamW runs at the rate measured beside the copies running at each moment: 1 s/param idle, 2
    beside uploads, 3 beside downloads, 4 beside both."""
    rates = HostRates(_host_adam(1.0, 2.0, 3.0, 4.0), h2d=[(2.0, 6.0)], d2h=[(4.0, 8.0), (9.0, 9.0)])
    assert rates.end(0.0, 1.0) == 1.0  # idle
    assert rates.end(0.0, 3.0) == pytest.approx(2.0 + 2.0)  # 2 idle, then 1 beside uploads
    assert rates.end(3.0, 0.75) == pytest.approx(5.0)  # 0.5 beside uploads until 4, 0.25 beside both
    # from 3: 0.5 params beside uploads until 4, 0.5 beside both until 6, 2/3 beside downloads until 8, then 1
    # idle until 9 (the empty span is no copy)
    assert rates.end(3.0, 0.5 + 0.5 + 2 / 3 + 1.0) == pytest.approx(9.0)


def test_a_copy_runs_at_the_rates_beside_what_runs_during_it():
    """A copy to the device at 2 B/s alone and 1 B/s beside the host's AdamW (busy from 1 s to 2 s) runs at each
    moment at the rate then, so its time moves smoothly with its start, as two profiles of one model move it."""
    hardware = linked(synthetic(), rate=2.0, h2d_beside_host=1.0).hardware
    link = Link(hardware, host=[(1.0, 2.0)])
    assert link.seconds("h2d", 2.0, 0.0) == 1.0  # before the host's work
    assert link.seconds("h2d", 3.0, 0.5) == pytest.approx(2.0)  # 0.5 s alone, 1 s beside it, 0.5 s alone
    assert link.seconds("h2d", 1.0, 1.5) == pytest.approx(0.75)  # 0.5 s beside it, then 0.25 s alone
    before, after = link.seconds("h2d", 3.0, 1.0 - 1e-6), link.seconds("h2d", 3.0, 1.0 + 1e-6)
    assert after == pytest.approx(before, abs=1e-5)  # (at its start's rate alone: 1.5 s against 3.0 s)
    assert link.seconds("d2h", 3.0, 0.5) == pytest.approx(1.5)  # (this profile's downloads run alike beside it)


def test_copies_beside_the_host_optimizer_slow_offloaded_plans():
    """Slower host rates beside copies lengthen the step of a plan whose host optimizer is on the critical path,
    and change nothing where every chunk is persistent."""
    model = synthetic()
    offloaded, persistent = Candidate(n_persist=2, n_buffer=2), Candidate(n_persist=model.n_chunk, n_buffer=0)
    alone = dataclasses.replace(model, hardware=_host_adam(2e-9, 2e-9, 2e-9, 2e-9))
    shared = dataclasses.replace(model, hardware=_host_adam(2e-9, 3e-9, 3e-9, 4e-9))
    assert shared.step_s(offloaded) > alone.step_s(offloaded)
    assert shared.phases(offloaded)["cpu_optim_s"] > alone.phases(offloaded)["cpu_optim_s"]
    assert shared.step_s(persistent) == alone.step_s(persistent)


def test_the_next_forward_waits_for_the_host_optimizer():
    """Offloaded chunks step on the host as their gradients arrive, one after another; the next forward loads a
    chunk only once it is stepped. A host fast enough costs nothing; past that, every extra second the host
    spends on the offloaded chunks is a second of step time."""
    model = synthetic()
    config = Candidate(n_persist=2, n_buffer=2)
    offloaded = sum(model.chunk_params[2:])

    def with_host(s_per_param):
        return dataclasses.replace(model, hardware=_host_adam(s_per_param, s_per_param, s_per_param, s_per_param))

    fast = with_host(0.0).phases(config)
    assert fast["cpu_optim_wait_s"] == 0.0
    assert with_host(0.0).step_s(config) == pytest.approx(fast["forward_s"] + fast["backward_s"] + fast["gpu_optim_s"])
    slow, slower = with_host(1e-9), with_host(2e-9)
    assert slow.phases(config)["cpu_optim_wait_s"] > 0
    assert slower.step_s(config) - slow.step_s(config) == pytest.approx(offloaded * 1e-9)


def test_clipped_steps_overlap_the_host_updates_where_undoing_them_pays():
    """With clipping, each offloaded chunk's host update either waits for the backward's end or runs beside it,
    copying aside what it changes (the last `clipped` chunks, whose gradients arrive first). The copy is host work
    like the AdamW: while the host nearly keeps up with the backward, overlapping costs little and waiting costs
    the host's work; where the copy makes the host the bottleneck, fewer chunks overlap. The plan takes the fastest
    count, and says what a clipped step costs."""
    model = synthetic()
    config = Candidate(n_persist=2, n_buffer=2)
    offloaded = model.n_chunk - 2
    chunk = model.chunk_params[2]

    def host(adam, undo):
        profile = dataclasses.replace(_host_adam(adam, adam, adam, adam), host_undo_s_per_param=undo)
        return dataclasses.replace(model, hardware=profile)

    backward = model.phases(config)["backward_s"]
    cheap = host(0.2 * backward / chunk, 0.02 * backward / chunk)
    costly = host(0.2 * backward / chunk, 0.6 * backward / chunk)
    assert cheap.step_s(config) <= cheap.step_s(config, clipped=offloaded) < cheap.step_s(config, clipped=0)
    assert costly.step_s(config, clipped=offloaded) > costly.step_s(config, clipped=0)
    layout = ChunkLayout(chunk_elems=model.chunk_elems, element_size=2, world_size=1, slots=(), n_chunk=model.n_chunk)
    forced = {"n_persist": 2, "n_buffer": 2, "n_swap": 0, "n_checkpoint": 0}
    for costs in (cheap, costly):
        plan = plan_graph(costs, forced, layout, None)
        times = [costs.step_s(config, clipped=k) for k in range(offloaded + 1)]
        assert plan.predicted_clipped_step_s == min(times) == times[plan.n_clip_overlap]
    chosen = [plan_graph(costs, forced, layout, None).n_clip_overlap for costs in (cheap, costly)]
    assert chosen[0] > chosen[1] and chosen[0] > 0, chosen
    assert plan_graph(cheap, {**forced, "n_clip_overlap": 1}, layout, None).n_clip_overlap == 1
    with pytest.raises(ValueError, match="n_clip_overlap.*exceeds the 4 offloaded chunks"):
        plan_graph(cheap, {**forced, "n_clip_overlap": 5}, layout, None)


def test_matmuls_are_timed_at_the_clocks_of_a_sustained_workload():
    """A device at its power limit runs matmuls slower throughout training than in the profiler's short bursts,
    more where more of its time is matmuls: the cost model stretches the matmul nodes by the hardware profile's
    figure at the graph's matmul share, and nothing else."""
    from protrain_fx.profiler.profile import GraphProfile, NodeProfile, aggregate_blocks

    def node(name, target, graph, block, seconds):
        return NodeProfile(name, target, graph, "block", block, seconds, 0, 0, 0, 0)

    nodes = [
        node(f"{g}{b}{k}", target, g, b, seconds)
        for g, blocks in (("forward", (0, 1)), ("backward", (1, 0)))
        for b in blocks
        for k, (target, seconds) in enumerate([("aten.mm.default", 0.003), ("aten.add.Tensor", 0.001)])
    ]
    profile = GraphProfile("cuda", 0.008, 0.008, 0, 0, 0, nodes, aggregate_blocks(nodes))
    assert H100_LIKE.sustained_matmul_stretch(0.75) == 1.0  # not measured: as profiled
    hot = dataclasses.replace(H100_LIKE, matmul_stretch_sustained=((0.5, 1.04), (1.0, 1.16)))
    assert hot.sustained_matmul_stretch(0.25) == pytest.approx(1.02)
    assert hot.sustained_matmul_stretch(0.75) == pytest.approx(1.10)
    assert hot.sustained_matmul_stretch(1.0) == hot.sustained_matmul_stretch(2.0) == pytest.approx(1.16)
    cool, warm = (CostModel.build(profile, hw, n_block=2) for hw in (H100_LIKE, hot))
    assert cool.block_fwd_s == pytest.approx((0.004, 0.004))
    assert warm.block_fwd_s == pytest.approx((0.003 * 1.10 + 0.001,) * 2)  # the matmul share is 0.75
    assert warm.block_bwd_s == pytest.approx((0.003 * 1.10 + 0.001,) * 2)
    assert warm.backward_matmul_share == pytest.approx(0.0033 / 0.0043)
    assert (cool.matmul_stretch, warm.matmul_stretch) == (1.0, pytest.approx(1.10))


def test_a_forced_n_persist_that_leaves_fewer_chunks_offloaded_than_buffers_is_planned():
    """n_persist forced to one chunk short of all: one chunk offloaded, fewer than the least buffers searched;
    the plan takes the least buffers instead of finding no configuration."""
    model = synthetic()
    best, _ = search(model, None, {"n_persist": model.n_chunk - 1})
    assert best[0].n_persist == model.n_chunk - 1 and best[0].n_buffer in (2, 3)
