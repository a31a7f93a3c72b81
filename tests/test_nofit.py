"""NoPlanFits (planner/nofit.py, raised by planner/search.py) says what was forced and what each lever gives, in
numbers from the same cost model, on the synthetic profiles of cost_models.py: the plan the search finds with a
forced n_persist searched instead, the host memory needed and what there is, and the largest share of the batch
that fits, checked by scaling the model's activations by it."""

import dataclasses
import re

import pytest
from cost_models import capacities, synthetic

from protrain_fx.planner.chunking import ChunkLayout
from protrain_fx.planner.cost import Candidate, CostModel
from protrain_fx.planner.nofit import GENERIC_ORIGIN
from protrain_fx.planner.search import NoPlanFits, brute_force, plan_graph

GiB = 2**30


def _layout(model: CostModel) -> ChunkLayout:
    return ChunkLayout(chunk_elems=model.chunk_elems, element_size=2, world_size=1, slots=(), n_chunk=model.n_chunk)


def _scaled(model: CostModel, share: float) -> CostModel:
    """The model of a batch `share` times as large: every activation term scaled (what the estimate assumes)."""
    scale = lambda values: tuple(int(v * share) for v in values)  # noqa: E731
    return dataclasses.replace(
        model,
        segments=tuple(dataclasses.replace(s, peak=int(s.peak * share)) for s in model.segments),
        block_saved=scale(model.block_saved),
        block_output=scale(model.block_output),
        block_transient=scale(model.block_transient),
    )


def _fits(model: CostModel, capacity: int, host: int | None = None) -> bool:
    """A plan fits (with the search's last resort, as the error's estimate)."""
    try:
        plan_graph(model, {}, _layout(model), capacity, host)
    except NoPlanFits:
        return False
    return True


def _batch_share(message: str) -> float:
    found = re.search(r"a smaller batch: about (\d\.\d\d)x the current one fits", message)
    assert found, message
    return float(found.group(1))


def test_too_little_gpu_gives_the_smallest_need_and_a_batch_that_fits():
    """Nothing forced, no plan fits the GPU: the smallest need, the largest share of the batch that fits (a model
    with its activations scaled by it fits; by 0.02 more, not), more GPUs, and that host memory is not the limit."""
    model = synthetic()
    least = min(model.reserved_bytes(c) for c, _, _ in brute_force(model, None))
    capacity = int(least * 0.9)
    with pytest.raises(NoPlanFits) as err:
        plan_graph(model, {}, _layout(model), capacity)
    message = str(err.value)
    assert f"needs {err.value.peak_bytes / GiB:.2f} GiB, the GPU has {capacity / GiB:.2f} GiB for it." in message
    share = _batch_share(message)
    assert err.value.forced == {} and "forced by" not in message
    assert 0 < share < 0.9 and share == pytest.approx(err.value.batch.share, abs=0.01)
    assert _fits(_scaled(model, share), capacity) and not _fits(_scaled(model, share + 0.02), capacity)
    activations = model.activation_peak(model.modes(err.value.batch.config))
    assert f"{err.value.batch.config}: {activations / GiB:.2f} GiB of activations as profiled" in message
    assert "- more GPUs: chunks are sharded across ranks" in message
    assert "- more host memory would not help: the smallest plan offloads 6 of the 6 chunks already" in message


@pytest.mark.parametrize("compute", [1, 5])
def test_a_forced_n_persist_is_named_with_the_plan_that_fits_with_it_searched(compute):
    """All chunks persistent, forced (as prepare with n_persist or the user's plan does): the error names the field
    and where it came from, and gives the plan the search finds with it searched (that of an unforced
    plan_graph), its GPU and host bytes, and the most persistent chunks that fit where the search keeps fewer
    (with slow blocks, recompute costs more than uploads hidden behind them); a smaller batch cannot help (the
    states alone are over)."""
    model = synthetic()
    times = {"block_fwd_s": model.block_fwd_s, "block_bwd_s": model.block_bwd_s}
    model = dataclasses.replace(model, **{k: tuple(t * compute for t in v) for k, v in times.items()})
    layout, capacity, host = _layout(model), capacities(model)[3], 200 * GiB
    searched = plan_graph(model, {}, layout, capacity, host)
    assert searched.n_persist < model.n_chunk
    with pytest.raises(NoPlanFits) as err:
        plan_graph(model, {"n_persist": 6}, layout, capacity, host, forced_by={"n_persist": "the chunks already built"})
    message = str(err.value)
    assert message.startswith("no plan fits the GPU: the smallest (Candidate(n_persist=6, ")
    assert "for it, with n_persist=6 forced by the chunks already built. What would make it fit:" in message
    config = Candidate(searched.n_persist, searched.n_buffer, searched.n_swap, searched.n_checkpoint)
    assert err.value.forced == {"n_persist": 6} and err.value.released.config == config
    assert (
        f"- with n_persist searched instead, the search plans n_persist={searched.n_persist} "
        f"n_buffer={searched.n_buffer} n_swap={searched.n_swap} n_checkpoint={searched.n_checkpoint} n_selective=0: "
        f"predicted {searched.predicted_reserved_bytes / GiB:.2f} GiB of the GPU and "
        f"{model.host_bytes(config) / GiB:.2f} GiB of host memory" in message
    )
    most = max(c.n_persist for c, _, _ in brute_force(model, capacity, host_bytes=host))
    assert (f"; at most n_persist={most} fits." in message) == (most != searched.n_persist), most
    assert most != searched.n_persist or compute == 1
    # the last resort (persistent chunks sharing two gradient buffers) was tried too: its states are the least
    sharing = dataclasses.replace(model, share_device_grads=True)
    states = sharing.reserved_bytes(Candidate(6), sharing.state_bytes(Candidate(6)) + model.other_bytes)
    assert states > capacity
    assert (
        f"- a smaller batch would not do: even with no activations the plans need at least {states / GiB:.2f}"
        in message
    )
    assert "more host memory would not help" not in message
    with pytest.raises(NoPlanFits, match=re.escape(f"n_persist=6 forced by {GENERIC_ORIGIN}. What")):
        plan_graph(model, {"n_persist": 6}, layout, capacity, host)


def test_too_little_host_for_the_plan_that_would_fit_says_offloading_is_not_available():
    """n_persist forced too high for the GPU, and the host too small to offload what the GPU has no room for: the
    error says how much host memory offloading would need and how much there is."""
    model = synthetic()
    layout, capacity = _layout(model), capacities(model)[2]
    sharing = dataclasses.replace(model, share_device_grads=True)  # (the search's last resort, the least host)
    needed = min(sharing.least_host_bytes(c) for c, _, _ in brute_force(sharing, capacity) if c.n_persist < 6)
    with pytest.raises(NoPlanFits) as err:
        plan_graph(model, {"n_persist": 6}, layout, capacity, needed - 1)
    message = str(err.value)
    assert (
        f"- with n_persist searched instead, the plans that fit the GPU offload chunks and need at least "
        f"{needed / GiB:.2f} GiB of host memory" in message
    )
    assert f"this rank has {(needed - 1) / GiB:.2f} GiB: offloading is not available on this host" in message
    assert err.value.released.error.host_needed == needed


def test_too_little_host_gives_the_host_needed_and_a_batch_that_fits():
    """Nothing forced, plans fit the GPU but not the host: the host memory the least of them needs and what there
    is, and the share of the batch with which a plan keeping more chunks on the GPU fits both."""
    model = synthetic()
    capacity = capacities(model)[3]
    fits_gpu = [c for c, _, _ in brute_force(model, capacity)]
    least = min(model.least_host_bytes(c) for c in fits_gpu)
    host = least - 1
    with pytest.raises(NoPlanFits) as err:
        plan_graph(model, {}, _layout(model), capacity, host)
    message = str(err.value)
    assert err.value.host_needed > host
    assert (
        f"need at least {err.value.host_needed / GiB:.2f} GiB of it for this rank (the least, {err.value.config}, "
        f"for its offloaded chunks' masters, AdamW states and gradients and its swap space), and there are "
        f"{host / GiB:.2f} GiB: too little to offload the chunks the GPU has no room for." in message
    )
    share = _batch_share(message)
    assert 0 < share < 1
    assert _fits(_scaled(model, share), capacity, host) and not _fits(_scaled(model, share + 0.02), capacity, host)
    assert "- more GPUs: each rank holds its shard of the offloaded chunks" in message


def test_too_little_host_on_a_machine_of_several_ranks_says_what_the_machine_lacks():
    """Ranks of one machine share its host (torchrun's LOCAL_WORLD_SIZE): the error also says what they need of it
    together and what it gives them."""
    model = synthetic()
    capacity = capacities(model)[3]
    host = min(model.least_host_bytes(c) for c, _, _ in brute_force(model, capacity)) - GiB
    with pytest.raises(NoPlanFits) as err:
        plan_graph(model, {}, _layout(model), capacity, host, machine_ranks=4)
    needed = err.value.host_needed
    assert (
        f"and there are {host / GiB:.2f} GiB (4 ranks share this machine's host: {4 * needed / GiB:.2f} GiB in all, "
        f"of the {4 * host / GiB:.2f} GiB it gives them): too little" in str(err.value)
    )


def test_compiling_in_the_process_is_a_lever_only_where_compile_workers_kept_host_memory():
    """TORCHINDUCTOR_COMPILE_THREADS=1 is named only where the host capacity kept memory for inductor's compile
    workers, with how much, and whether that alone is enough."""
    model = synthetic()
    capacity = capacities(model)[3]
    host = min(model.least_host_bytes(c) for c, _, _ in brute_force(model, capacity)) - GiB

    def message(workers: int) -> str:
        with pytest.raises(NoPlanFits) as err:
            plan_graph(model, {}, _layout(model), capacity, host, compile_workers_bytes=workers)
        return str(err.value)

    assert "TORCHINDUCTOR_COMPILE_THREADS" not in message(0)
    lever = "- set TORCHINDUCTOR_COMPILE_THREADS=1: inductor then compiles in this process, and the 8.00 GiB of host"
    assert f"{lever} memory kept for its compile workers go to the model (enough)" in message(8 * GiB)
    assert "go to the model (not enough alone: 1.00 GiB are missing)" in message(GiB // 2)


def test_forced_block_modes_are_named_by_their_counts_and_searched_with_the_rest():
    model = synthetic()
    layout, capacity = _layout(model), capacities(model)[2]
    forced = {"n_persist": 2, "block_modes": ("swap",) + ("checkpoint",) * 7}  # (n_buffer searched)
    with pytest.raises(NoPlanFits) as err:
        plan_graph(model, forced, layout, capacity, forced_by={"block_modes": "options['plan']"})
    message = str(err.value)
    assert (
        f"with n_persist=2 forced by {GENERIC_ORIGIN}; block_modes (1 swap, 7 checkpoint, 0 selective of 8 blocks)"
        in message
    )
    assert "forced by options['plan']. What would make it fit:" in message
    searched = plan_graph(model, {}, layout, capacity)
    assert (
        f"- with n_persist, block_modes searched instead, the search plans n_persist={searched.n_persist} " in message
    )
