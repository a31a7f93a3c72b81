"""The search (paper §4.3): the fastest configuration whose predicted peak fits the GPU (and whose offloaded
chunks and swap space fit the host memory).

    best, runners_up = search(model, capacity_bytes, forced={"n_swap": 0})

Exhaustive over n_swap, n_checkpoint, n_selective (where the profile prices it: planner/selective.py), n_buffer
and n_persist with the paper's pruning; with several ranks also over n_device_shard (the chunks after the persistent
ones sharded on the device), in two stages: each configuration with none and with the most that fit, then every
count for the block layouts and buffer counts of the best and runners-up (`_every_shard_of_the_best`; every count
everywhere would multiply the configurations by the chunks):
- n_swap is bounded by the swap interval: each swapped block needs swap_interval blocks of compute to hide its
  copy behind, so n_swap <= n_block // swap_interval;
- what depends on the block modes alone (the activation peak, the recompute seconds, the per-chunk split) is
  computed once per block layout (`_ByModes`), not once per configuration;
- for one block layout and buffer count, memory grows with n_persist, so n_persist is visited upwards and
  the first configuration over capacity ends that row (every later one is larger);
- configurations over capacity are never timed; nor are those whose least host memory
  (`CostModel.least_host_bytes`, its offloaded chunks sharing the fewest gradient shards: shrinks as n_persist
  grows) is over what this rank has. Those timed get one gradient shard per offloaded chunk where the host has
  room, else as many as it has, and their backward waits for the host where they are too few
  (`CostModel.grad_slots`);
- those that fit are timed in the order of a lower bound of their step time, until the bound passes every step
  time `rank` can still use (`_timed`): the result is that of timing them all. The bound is refined lazily: first
  `CostModel.step_floor_s` (a few operations: compute, uploads, swap copies, the device AdamW, the host AdamW from
  the first gradient's landing), then, for a configuration that comes first with it, `CostModel.step_bound_s`
  (the timelines' first pass and the host AdamW from each gradient's landing there), each also of the step whose
  clip applies (its host AdamW from the end of the backward and the device's AdamW on), weighted as ranked.
Configurations are ranked by the mean of two step times, with the host's work as profiled (the plan's
`predicted_step_s`) and HOST_SLOWDOWN times as long (`predicted_slow_host_step_s`), weighing 1 - CLIP_WEIGHT,
and by the step whose clip applies, the host as profiled, weighing CLIP_WEIGHT. The host's AdamW rate in training
differs from the profile's by machine and run, and a plan whose offloaded chunks' updates land just before the next
forward needs them is fastest at the profiled rate and loses the most where the host is slower. The mean, not the
slow time alone: where the host bounds every plan, their slow times are all alike. Where a clip applies, every
update waits for `optimizer.step()` (`CostModel.step_s(config, clipped=0)`), and most training loops clip (Hugging
Face's Trainer by default, accelerate, torchtitan): a plan a hair faster unclipped can be far slower there.
Among those that fit, the lowest so ranked wins. Ties (within `tie_rel`: the profile's timing noise, at least
TIE_REL, CPU_TIE_REL on the CPU) go to the one that rewrites the model least (fewest blocks checkpointed, selective
or swapped, then most chunks persistent) among those leaving at least SAFE_HEADROOM of the capacity free, else to
the one with the most headroom. (A swap hidden behind compute is priced at nothing, but its copies, events and
settle points take some time: with memory to spare it buys nothing.) Two profiles of one model differ by their
noise, and plans whose copies hide behind the compute are predicted within a fraction of a percent of each other:
a margin under the noise would let the noise choose between them, so it counts as a tie. A field the user forces
keeps its value and the rest are searched.

Last resort (`plan_graph`): where nothing fits, the search runs again with the persistent chunks sharing
MIN_GRAD_SLOTS gradient buffers on the device instead of one each (`CostModel.share_device_grads`): the GPU
then holds more chunks and the host fewer. It is not the first choice: a step whose updates wait for
`optimizer.step()` (clipping, accumulation) holds every persistent gradient, which such a plan has no room for.
Where that fits neither, NoPlanFits (planner/nofit.py) names the forced fields and what searching them instead gives
(`_released`), and the share of the batch that would fit (`batch_share`).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from protrain_fx.planner.chunking import ChunkLayout
from protrain_fx.planner.cost import Candidate, CostModel, ModeTerms
from protrain_fx.planner.nofit import NoPlanFits, Released, batch_share
from protrain_fx.planner.plan import (
    LEAST_BUFFERS,
    LEAST_BUFFERS_RECOMPUTING,
    MODE_COUNTS,
    Plan,
    make_plan,
    master_bytes,
)

log = logging.getLogger(__name__)

HOST_SLOWDOWN = 1.3  # configurations are ranked also by their step time with the host's work this many times as long
CLIP_WEIGHT = 0.1  # loops clip, so a plan a hair faster unclipped but far slower when the clip applies must lose
TIE_REL = 0.005  # step times within 0.5% count as equal, or within the profile's timing noise where it is more
MAX_TIE_REL = 0.05  # ... up to 5%: a noisier profile does not make slower plans equal
# on the CPU (copies share the compute's cores), 5%: its speed against the hardware profile's cached rates moves
# between profiles by more than one profile's own timed runs show, and with ties of 2% a small model's plans changed
CPU_TIE_REL = 0.05
SAFE_HEADROOM = 0.1  # a plan predicted to leave this share of the capacity free needs no more headroom
# buffers searched: one in use, one loading, one recomputed from, one spare (more where the graphs hold more chunks
# at once; else forced only)
MAX_BUFFER = 4
N_RUNNERS_UP = 3
BOUND_ROUNDING = 1e-9  # step-time bounds are taken this much lower: where one adds up to the step, it may round above

Ranked = tuple[Candidate, float, int]  # a configuration, its step seconds as ranked (`ranked_step_s`), its peak bytes


def _values(forced: Mapping[str, Any], key: str, values) -> list[int]:
    return [forced[key]] if key in forced else list(values)


def _block_counts(model: CostModel, forced: Mapping[str, Any]):
    """(n_swap, n_checkpoint, n_selective) of every block layout searched: selective blocks only where the profile
    prices them."""
    n_swap_max = model.n_block // model.swap_interval
    for n_swap in _values(forced, "n_swap", range(n_swap_max + 1)):
        for n_checkpoint in _values(forced, "n_checkpoint", range(model.n_block - n_swap + 1)):
            selective = range(model.n_block - n_swap - n_checkpoint + 1) if model.prices_selective else [0]
            for n_selective in _values(forced, "n_selective", selective):
                if n_swap + n_checkpoint + n_selective <= model.n_block:
                    yield n_swap, n_checkpoint, n_selective


def candidates(model: CostModel, forced: Mapping[str, Any], *, every_shard: bool = True):
    """Every configuration the search considers, in rows of one block layout, buffer count and count of chunks
    sharded on the device, and increasing n_persist (so of increasing memory). Chunks sharded on the device: as
    forced, else every count where several ranks shard them (`every_shard`; else none: `_scan` adds the most
    that fit), none with one rank."""
    both_forced = {"n_buffer", "n_persist"} <= forced.keys()  # (then the chunk pass says what the graph needs)
    for counts in _block_counts(model, forced):
        if model.n_chunk == 0:
            yield [Candidate(0, 0, *counts)]
            continue
        # buffers in use at once: the chunk computing and the one loading, and with recompute the chunk the
        # recomputed block reads; and at least what the graphs hold at once (the chunk passes reject fewer)
        least = LEAST_BUFFERS_RECOMPUTING if counts[1] or counts[2] else LEAST_BUFFERS
        for n_buffer in _values(forced, "n_buffer", range(least, max((MAX_BUFFER, *model.least_buffers)) + 1)):
            shards = range(model.n_chunk + 1) if every_shard and model.world_size > 1 else [0]
            for n_device_shard in _values(forced, "n_device_shard", shards):
                row = []
                for n_persist in _values(forced, "n_persist", range(model.n_chunk - n_device_shard + 1)):
                    offloaded = model.n_chunk - n_persist  # (gathered: sharded on the device or the host)
                    if n_device_shard > offloaded:  # (a forced n_persist leaves fewer)
                        continue
                    if offloaded and n_buffer < _needed(model, n_persist) and not both_forced:
                        continue
                    if offloaded and n_buffer > offloaded and "n_buffer" not in forced:
                        # (a forced count is the user's: more buffers than chunks only costs memory; so does the
                        # least count where the user's n_persist leaves fewer chunks offloaded)
                        if "n_persist" not in forced or n_buffer != least:
                            continue
                    n_swap, n_checkpoint, n_selective = counts
                    row.append(
                        Candidate(
                            n_persist,
                            n_buffer if offloaded else 0,
                            n_swap,
                            n_checkpoint,
                            n_selective,
                            n_device_shard=n_device_shard,
                        )
                    )
                yield row


def _needed(model: CostModel, n_persist: int) -> int:
    """The fewest chunk buffers the graphs run with, the first `n_persist` chunks persistent (0: not known)."""
    return model.least_buffers[n_persist] if model.least_buffers else 0


class _ByModes:
    """What a configuration's costs read of its block modes alone (`CostModel.mode_terms`), computed once per
    block layout."""

    def __init__(self, model: CostModel):
        self.model = model
        self.known: dict[tuple[int, int, int], ModeTerms] = {}

    def __call__(self, config: Candidate) -> ModeTerms:
        key = (config.n_swap, config.n_checkpoint, config.n_selective)
        if key not in self.known:
            self.known[key] = self.model.mode_terms(config)
        return self.known[key]


def states_alone(model: CostModel, capacity_bytes: int | None, host_bytes: int | None) -> None:
    """NoPlanFits where no configuration of a chunk layout fits the GPU and the host with its model states alone
    (`model`: `CostModel.of_states`, no activations and nothing else held), as the search will say once the graph
    is profiled."""
    model = dataclasses.replace(model, host_budget=host_bytes)
    fitting, smallest, least_host = _scan(model, capacity_bytes, {}, host_bytes, _ByModes(model))
    if not fitting:
        raise _no_fit(model, {}, smallest, least_host, capacity_bytes, host_bytes)


def _no_fit(model: CostModel, forced, smallest, least_host, capacity_bytes, host_bytes) -> NoPlanFits:
    """The error where `_scan` found no configuration that fits: the GPU's or, where some fit it, the host's."""
    assert smallest is not None, "no configuration to search"
    batch = batch_share(model, itertools.chain.from_iterable(candidates(model, forced)), capacity_bytes, host_bytes)
    if least_host is not None:
        return NoPlanFits(
            smallest[0], least_host[1], capacity_bytes, least_host[0], host_bytes, n_chunk=model.n_chunk, batch=batch
        )
    return NoPlanFits(smallest[0], smallest[1], capacity_bytes, n_chunk=model.n_chunk, batch=batch)


def _scan(
    model: CostModel,
    capacity_bytes: int | None,
    forced: Mapping[str, Any],
    host_bytes: int | None,
    by_modes,
    *,
    every_shard: bool = False,
):
    """The configurations that fit the GPU and the host, as (config, peak); the one of least GPU memory, as
    (reserved, config); and of those that fit the GPU but not the host, the one of least host memory, as (host
    bytes, config) (None where none). Chunks sharded on the device (several ranks, unless forced): each
    configuration with none and with the most that fit (`_most_device_shards`); `every_shard`: every count."""
    fitting: list[tuple[Candidate, int]] = []
    smallest: tuple[int, Candidate] | None = None
    least_host: tuple[int, Candidate] | None = None
    seen: set[Candidate] = set()
    most = _shards_searched(model, forced) and not every_shard
    for row in candidates(model, forced, every_shard=every_shard):
        for config in row:  # n_persist upwards: GPU memory only grows along a row, host memory only shrinks
            terms = by_modes(config)
            peak = model.peak_bytes(config, terms)
            reserved = model.reserved_bytes(config, peak)
            if smallest is None or reserved < smallest[0]:
                smallest = (reserved, config)
            if capacity_bytes is not None and reserved > capacity_bytes:
                break
            variants = [config, _most_device_shards(model, config, capacity_bytes, terms)] if most else [config]
            for variant in variants:
                if host_bytes is not None and (host := model.least_host_bytes(variant, terms)) > host_bytes:
                    if least_host is None or host < least_host[0]:
                        least_host = (host, variant)
                    continue
                if variant not in seen:
                    seen.add(variant)
                    fitting.append((variant, model.peak_bytes(variant, terms)))
    return fitting, smallest, least_host


def _most_device_shards(model: CostModel, config: Candidate, capacity_bytes: int | None, terms: ModeTerms) -> Candidate:
    """`config` with as many of the chunks after its persistent ones sharded on the device as fit `capacity_bytes`
    (all where it is not known): the count the search tries first (`search`). (Memory grows with the count: found
    by bisection.)"""

    def fits(n: int) -> bool:
        sharded = dataclasses.replace(config, n_device_shard=n)
        return (
            capacity_bytes is None or model.reserved_bytes(sharded, model.peak_bytes(sharded, terms)) <= capacity_bytes
        )

    lo, hi = config.n_device_shard, model.n_chunk - config.n_persist
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return dataclasses.replace(config, n_device_shard=lo)


def _shards_searched(model: CostModel, forced: Mapping[str, Any]) -> bool:
    """Whether the search places chunks sharded on the device: with several ranks, unless the count is forced."""
    return model.world_size > 1 and "n_device_shard" not in forced


def _every_shard_of_the_best(
    model: CostModel,
    fits: list[Ranked],
    fitting: list[tuple[Candidate, int]],
    capacity_bytes: int | None,
    forced: Mapping[str, Any],
    by_modes: _ByModes,
) -> list[tuple[Candidate, int]]:
    """For the block layouts and buffer counts of the best and runners-up among `fits` (timed, each with no chunk or
    the most sharded on the device), every configuration of any n_persist and count sharded on the device that fits,
    but those of `fitting` (already searched): where a chunk goes is searched in full for the layouts that win, not
    for every layout (the counts multiply the configurations by the chunks)."""
    best, runners_up = rank(fits, capacity_bytes, alpha=model.alpha, tie=tie_rel(model), offset=model.step_offset_s)
    layouts = {(c.n_swap, c.n_checkpoint, c.n_selective, c.n_buffer) for c, _, _ in [best, *runners_up] if c.n_buffer}
    seen, more = {c for c, _ in fitting}, []
    for n_swap, n_checkpoint, n_selective, n_buffer in sorted(layouts):
        fixed = {
            **forced,
            "n_swap": n_swap,
            "n_checkpoint": n_checkpoint,
            "n_selective": n_selective,
            "n_buffer": n_buffer,
        }
        found, _, _ = _scan(model, capacity_bytes, fixed, model.host_budget, by_modes, every_shard=True)
        more += [(c, peak) for c, peak in found if c not in seen]
        seen.update(c for c, _ in found)
    return more


def search(
    model: CostModel,
    capacity_bytes: int | None,
    forced: Mapping[str, Any] | None = None,
    host_bytes: int | None = None,
):
    """The best configuration as (Candidate, step seconds as ranked: `ranked_step_s`, peak bytes), and the runners-up
    likewise. `host_bytes`: the host memory this rank has for offloaded chunks and swap space (None: not
    budgeted). Raises NoPlanFits."""
    forced = dict(forced or {})
    model = dataclasses.replace(model, host_budget=host_bytes)
    by_modes = _ByModes(model)
    fitting, smallest, least_host = _scan(model, capacity_bytes, forced, host_bytes, by_modes)
    if not fitting:
        raise _no_fit(model, forced, smallest, least_host, capacity_bytes, host_bytes)
    fits = _timed(model, fitting, by_modes)
    if _shards_searched(model, forced):
        # (those of the first stage not timed stay so: the times it took can only lower the bar they missed)
        more = _every_shard_of_the_best(model, fits, fitting, capacity_bytes, forced, by_modes)
        fitting = [(c, peak) for c, _, peak in fits] + more
        fits = _timed(model, fitting, by_modes, known={c: step for c, step, _ in fits})
    log.info("timed %d of the %d configurations that fit", len(fits), len(fitting))
    return rank(fits, capacity_bytes, alpha=model.alpha, tie=tie_rel(model), offset=model.step_offset_s)


def tie_rel(model: CostModel) -> float:
    """The share within which step times count as equal: the profile's timing noise, at least TIE_REL (CPU_TIE_REL
    on the CPU, where copies share the compute's cores: `CostModel.overlap` False), at most MAX_TIE_REL."""
    least = TIE_REL if model.overlap else CPU_TIE_REL
    return max(least, min(MAX_TIE_REL, model.timing_noise))


def slow_host(model: CostModel) -> CostModel:
    """The cost model with the host's work HOST_SLOWDOWN times as long as profiled."""
    return dataclasses.replace(model, hardware=model.hardware.host_slower(HOST_SLOWDOWN))


def ranked_step_s(model: CostModel) -> Callable[[Candidate], float]:
    """What configurations are ranked by: 1 - CLIP_WEIGHT times the mean of their step times with the host as
    profiled and slow (`slow_host`), plus CLIP_WEIGHT times that of a step whose clip applies, the host as
    profiled (`step_s(config, clipped=0)`: no update starts before `optimizer.step()`). Never under
    `model.step_bound_s(config, host_scales=(1.0, HOST_SLOWDOWN), clip_weight=CLIP_WEIGHT)`, which weighs the
    three's bounds alike. (The clipped step is not always the longer: its copies run beside no host work.)"""
    slow = slow_host(model)

    def ranked(config: Candidate) -> float:
        profiled = model.step_s(config)
        # (where every update waits anyway, or no chunk is there to wait, a clipped step is timed as any)
        clipped = profiled if model.updates_wait or not model.n_chunk else model.step_s(config, clipped=0)
        return (1 - CLIP_WEIGHT) * (profiled + slow.step_s(config)) / 2 + CLIP_WEIGHT * clipped

    return ranked


def _timed(
    model: CostModel,
    fitting: list[tuple[Candidate, int]],
    by_modes: _ByModes,
    known: Mapping[Candidate, float] | None = None,
) -> list[tuple[Candidate, float, int]]:
    """(config, step seconds as ranked, peak) of those of `fitting` ((config, peak) pairs) whose step time `rank`
    can use: the ties of the fastest (within `tie_rel`) and the N_RUNNERS_UP + 1 fastest (the best and its
    runners-up). They are timed in the order of a lower bound of their step time, until the bound passes both:
    every one left is slower. Each bound weighs the bounds of the three step times `ranked_step_s` weighs alike:
    first `step_floor_s`, refined to `step_bound_s` when the configuration comes first with it. `known`: ranked
    step times already taken, not taken again. In the order of `fitting`."""
    ranked, tie, known = ranked_step_s(model), tie_rel(model), known or {}
    weighed = {"host_scales": (1.0, HOST_SLOWDOWN), "clip_weight": CLIP_WEIGHT}
    below = 1 - BOUND_ROUNDING  # (a bound that adds up to the step time may round above it)
    # (lower bound, refined, index); a floor that comes first is refined, a refined bound is timed
    heap = [
        (known[c] * below, True, i) if c in known else (model.step_floor_s(c, by_modes(c), **weighed) * below, False, i)
        for i, (c, _) in enumerate(fitting)
    ]
    heapq.heapify(heap)
    times: list[float] = []  # step times so far, ascending
    steps: dict[int, float] = {}
    while heap:
        bound, refined, i = heapq.heappop(heap)
        if len(times) > N_RUNNERS_UP and bound > max(_tied(times[0], tie, model.step_offset_s), times[N_RUNNERS_UP]):
            break
        config = fitting[i][0]
        if not refined:
            heapq.heappush(heap, (model.step_bound_s(config, by_modes(config), **weighed) * below, True, i))
            continue
        steps[i] = known[config] if config in known else ranked(config)
        bisect.insort(times, steps[i])
    return [(fitting[i][0], steps[i], fitting[i][1]) for i in sorted(steps)]


def rank(
    fits: list[tuple[Candidate, float, int]],
    capacity_bytes: int | None,
    *,
    alpha: float = 1.0,
    tie: float = TIE_REL,
    offset: float = 0.0,
):
    """(best, runners-up): the fastest; among ties within `tie` (a share of the fastest, less the calibrated
    `offset` every step has: `_tied`) the least rewritten plan whose predicted reserved bytes (peak times `alpha`,
    as `CostModel.reserved_bytes`) leave SAFE_HEADROOM of `capacity_bytes` free (any, with no capacity), else the
    lowest peak; then by step time."""
    fastest = min(step for _, step, _ in fits)
    ties = [f for f in fits if f[1] <= _tied(fastest, tie, offset)]
    safe = [f for f in ties if capacity_bytes is None or f[2] * alpha <= (1 - SAFE_HEADROOM) * capacity_bytes]
    if safe:
        best = min(safe, key=lambda f: (_rewritten(f[0]), -f[0].n_persist, f[1], f[2]))
    else:
        best = min(ties, key=lambda f: (f[2], f[1]))
    rest = sorted((f for f in fits if f is not best), key=lambda f: (f[1], f[2]))
    log.info(
        "best of %d configurations %s: %.1f ms as ranked, %.2f GiB",
        len(fits),
        best[0],
        best[1] * 1e3,
        best[2] / 2**30,
    )
    return best, rest[:N_RUNNERS_UP]


def _tied(fastest: float, tie: float, offset: float) -> float:
    """The slowest step time tied with `fastest`: within `tie` of it, as a share of its time less the `offset` that
    calibration adds to every plan's step (`CostModel.step_offset_s`), so that an offset moves no plan's rank."""
    return fastest + tie * (fastest - offset)


def _rewritten(config: Candidate) -> int:
    """Blocks whose activations the configuration does not keep as they are."""
    return config.n_swap + config.n_checkpoint + config.n_selective


def brute_force(
    model: CostModel,
    capacity_bytes: int | None,
    forced: Mapping[str, Any] | None = None,
    host_bytes: int | None = None,
):
    """Every configuration (step times as ranked: `ranked_step_s`), no pruning: what `search` must agree with
    (tests)."""
    forced = dict(forced or {})
    model = dataclasses.replace(model, host_budget=host_bytes)
    configs = set(itertools.chain.from_iterable(candidates(model, forced)))
    configs = {c for c in configs if host_bytes is None or model.least_host_bytes(c) <= host_bytes}
    ranked = ranked_step_s(model)
    fits = [(c, ranked(c), model.peak_bytes(c)) for c in configs]
    return [f for f in fits if capacity_bytes is None or model.reserved_bytes(f[0], f[2]) <= capacity_bytes]


SEARCHED = tuple(f.name for f in dataclasses.fields(Candidate))
# the fields a plan may force that the search would otherwise choose; where none fits, the error says what searching
# them gives
FORCEABLE = SEARCHED + ("block_modes", "host_grad_slots", "device_grad_slots")


def _search_with_last_resort(
    costs: CostModel, capacity_bytes: int | None, forced: Mapping[str, Any], may_share: bool
) -> tuple[Ranked, list[Ranked], CostModel]:
    """`search` under `costs.host_budget`, and where nothing fits and `may_share`, again with the persistent
    chunks sharing device gradient buffers (the last resort): (best, runners-up, the cost model they fit)."""
    try:
        return (*search(costs, capacity_bytes, forced, costs.host_budget), costs)
    except NoPlanFits:
        if not may_share:
            raise
        costs = dataclasses.replace(costs, share_device_grads=True)
        return (*search(costs, capacity_bytes, forced, costs.host_budget), costs)


def _released(
    costs: CostModel,
    forced: Mapping[str, Any],
    layout: ChunkLayout | None,
    capacity_bytes: int | None,
    host_bytes: int | None,
) -> Released:
    """What the search finds with the `forced` fields searched too (the host budgeted where n_persist is then
    searched), on a copy of `costs` that forces none of them."""
    still_forced = {} if costs.prices_selective else {"n_selective": 0}
    if layout is None:
        still_forced.update(n_persist=0, n_buffer=0)
    fields = tuple(k for k in forced if k not in still_forced)
    if not fields:
        return Released(())
    free = dataclasses.replace(
        costs,
        forced_modes=(),
        forced_grad_slots=None,
        forced_device_grad_slots=None,
        share_device_grads=False,
        host_budget=host_bytes if "n_persist" not in still_forced else None,
    )
    try:
        (config, _, peak), _, free = _search_with_last_resort(free, capacity_bytes, still_forced, layout is not None)
    except NoPlanFits as error:
        return Released(fields, error=error)
    most = None
    if "n_persist" in fields:
        fitting, _, _ = _scan(free, capacity_bytes, still_forced, free.host_budget, _ByModes(free))
        most = max(c.n_persist for c, _ in fitting)
    host = free.host_bytes(config) if layout is not None else 0
    return Released(fields, config, free.reserved_bytes(config, peak), host, most)


def plan_graph(
    costs: CostModel,
    forced: Mapping[str, Any],
    layout: ChunkLayout | None,
    capacity_bytes: int | None,
    host_bytes: int | None = None,
    *,
    forced_by: Mapping[str, str] | None = None,
    compile_workers_bytes: int = 0,
    machine_ranks: int = 1,
) -> Plan:
    """The plan of one graph: the forced fields kept (checked by make_plan), the rest searched, with the
    predictions and the runners-up. Fully forced plans are not searched; one predicted over capacity is kept,
    with a warning. The host memory (`host_bytes`) is budgeted only where `n_persist` is searched: a forced one
    is the user's or that of the model's chunks, already built (their host memory is in use, not available).
    Where none fits, NoPlanFits names the forced fields (`forced_by`: where each came from, as "options['plan']";
    default: nofit.GENERIC_ORIGIN), what searching them instead gives, and the host memory kept out of
    `host_bytes` for inductor's compile workers (`compile_workers_bytes`), which compiling in the process frees, and
    the ranks sharing this machine's host (`machine_ranks`)."""
    forced = dict(forced)
    make_plan(costs.n_block, forced, layout, swap_interval=costs.swap_interval)  # the user's fields, checked
    assert layout is None or costs.master_bytes == master_bytes(forced), "CostModel.build got another master_dtype"
    model = _forcing(costs, forced)
    counts = forced_counts(model, forced, layout)
    runners_up: list[Ranked] = []
    if all(k in counts for k in SEARCHED):
        best = _timed_as_forced(model, Candidate(**counts), capacity_bytes)
    else:
        if "n_persist" not in counts:
            model = dataclasses.replace(model, host_budget=host_bytes)
        may_share = layout is not None and "device_grad_slots" not in forced
        try:
            best, runners_up, model = _search_with_last_resort(model, capacity_bytes, counts, may_share)
        except NoPlanFits as error:
            # (with one rank no chunk is sharded on the device, whatever is searched: not a field to name)
            one_rank = {"n_device_shard"} if costs.world_size == 1 else set()
            searchable = {k: forced[k] for k in FORCEABLE if k in forced and k not in one_rank}
            released = _released(costs, searchable, layout, capacity_bytes, host_bytes) if searchable else None
            raise error.told(
                forced=searchable,
                forced_by=forced_by or {},
                released=released,
                compile_workers_bytes=compile_workers_bytes,
                machine_ranks=machine_ranks,
            ) from None
        if model.share_device_grads:
            _warn_device_grads_shared(model, best[0])
    plan = _to_plan(model, forced, layout, best, chosen=True)
    return dataclasses.replace(plan, runners_up=tuple(_to_plan(model, forced, layout, r) for r in runners_up))


def plan_fits(
    costs: CostModel,
    forced: Mapping[str, Any],
    layout: ChunkLayout | None,
    capacity_bytes: int | None,
    host_bytes: int | None = None,
) -> bool:
    """Whether `plan_graph` finds a plan that fits under `forced` (one of forced fields only: whether it is predicted
    within `capacity_bytes`), as it searches (the same host budget and last resort), timing none."""
    forced = dict(forced)
    make_plan(costs.n_block, forced, layout, swap_interval=costs.swap_interval)  # the user's fields, checked
    model = _forcing(costs, forced)
    counts = forced_counts(model, forced, layout)
    if all(k in counts for k in SEARCHED):
        return capacity_bytes is None or model.reserved_bytes(Candidate(**counts)) <= capacity_bytes
    if "n_persist" not in counts:
        model = dataclasses.replace(model, host_budget=host_bytes)
    shares = (False, True) if layout is not None and "device_grad_slots" not in forced else (False,)
    for share in shares:
        tried = dataclasses.replace(model, share_device_grads=share)
        if _scan(tried, capacity_bytes, counts, tried.host_budget, _ByModes(tried))[0]:
            return True
    return False


def _forcing(costs: CostModel, forced: Mapping[str, Any]) -> CostModel:
    """`costs` with the forced fields that are no count of the search: the block modes and the gradient slots."""
    if "host_grad_slots" in forced:
        costs = dataclasses.replace(costs, forced_grad_slots=forced["host_grad_slots"])
    if "device_grad_slots" in forced:
        costs = dataclasses.replace(costs, forced_device_grad_slots=forced["device_grad_slots"])
    if "block_modes" in forced:
        costs = dataclasses.replace(costs, forced_modes=tuple(forced["block_modes"]))
    return costs


def forced_counts(costs: CostModel, forced: Mapping[str, Any], layout: ChunkLayout | None) -> dict[str, int]:
    """The searched fields (`SEARCHED`) the search takes as they are: those forced, the mode counts of forced block
    modes, no selective block where the profile does not price them, and no chunk fields without a layout (no
    buffer where every chunk is forced persistent)."""
    counts = {k: forced[k] for k in SEARCHED if k in forced}
    if "block_modes" in forced:
        modes = tuple(forced["block_modes"])
        counts.update({key: modes.count(mode) for key, mode in MODE_COUNTS.items()})
    if not costs.prices_selective:
        counts.setdefault("n_selective", 0)
    # (one rank shards nothing: a chunk whole on the device is persistent; a forced n_clip_overlap is of offloaded
    # chunks, which sharding them on the device would take away)
    if costs.world_size == 1 or forced.get("n_clip_overlap"):
        counts.setdefault("n_device_shard", 0)
    if layout is None:
        counts.update(n_persist=0, n_buffer=0)
    elif counts.get("n_persist") == layout.n_chunk:
        counts["n_buffer"] = 0
    return counts


def _timed_as_forced(costs: CostModel, config: Candidate, capacity_bytes: int | None) -> Ranked:
    """A configuration with every searched field forced, timed (not ranked: nothing to rank it against); one
    predicted over capacity is kept, with a warning."""
    if capacity_bytes is not None and costs.reserved_bytes(config) > capacity_bytes:
        log.warning(
            "the forced plan %s is predicted to need %.2f GiB, more than the %.2f GiB the GPU has for it",
            config,
            costs.reserved_bytes(config) / 2**30,
            capacity_bytes / 2**30,
        )
    return config, costs.step_s(config), costs.peak_bytes(config)


def _warn_device_grads_shared(costs: CostModel, config: Candidate) -> None:
    """The search found a plan only with the persistent chunks sharing device gradient buffers (the last resort)."""
    log.warning(
        "no plan with a gradient buffer for each persistent chunk fits this machine: the %d "
        "persistent chunks share %d. Steps whose updates wait for optimizer.step() (gradient clipping, "
        "accumulation) hold every persistent gradient and need %.2f GiB more GPU memory",
        config.n_persist,
        costs.device_grad_slots(config),
        (config.n_persist - costs.device_grad_slots(config)) * costs.chunk_elems * costs.master_bytes / 2**30,
    )


def _to_plan(
    costs: CostModel, forced: Mapping[str, Any], layout: ChunkLayout | None, found: Ranked, *, chosen: bool = False
) -> Plan:
    """The plan of a configuration the search found (`found`: as `search` ranks it), with its predictions by
    `costs`. `chosen`: the plan in force, which also gets how a clipped step runs (runners-up are shown, not
    run)."""
    config, _, peak = found
    step_s = costs.step_s(config)
    fields: dict[str, Any] = dataclasses.asdict(config)
    if layout is None:
        fields = {k: v for k, v in fields.items() if k not in ("n_persist", "n_buffer")}
    clipped_s, fields["n_clip_overlap"] = None, 0
    if layout is not None:
        fields["host_grad_slots"] = costs.grad_slots(config)
        fields["device_grad_slots"] = costs.device_grad_slots(config)
    if chosen and layout is not None:  # how many offloaded chunks update during the backward of a clipped step
        options = [forced["n_clip_overlap"]] if "n_clip_overlap" in forced else range(costs.n_offloaded(config) + 1)
        clipped_s, fields["n_clip_overlap"] = min((costs.step_s(config, clipped=k), k) for k in options)
    elif chosen:
        clipped_s = step_s
    plan = make_plan(costs.n_block, {**forced, **fields}, layout, swap_interval=costs.swap_interval)
    return dataclasses.replace(
        plan,
        predicted_step_s=step_s,
        predicted_slow_host_step_s=slow_host(costs).step_s(config),
        predicted_clipped_step_s=clipped_s,
        predicted_host_adam_s_per_param=costs.host_adam_mean_s(config) if chosen else None,
        predicted_peak_bytes=peak,
        predicted_reserved_bytes=costs.reserved_bytes(config, peak),
    )
