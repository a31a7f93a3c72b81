"""Calibration: the cost model fitted again to what training measured, and whether the search then finds a plan
enough faster than the one in force to switch to it (the closed loop: runtime/replan.py).

    calibration = Calibration(host=1.5, alpha=1.12, forward=1.05, backward=1.2)  # the largest any rank measured
    costs = calibrated(record.costs, calibration)
    replan = replanned(costs, record.planning, record.plan, forced)
    if replan.switches: ...                               # put replan.plan in force

What is fitted again:
- `host`: training's host AdamW seconds per parameter over the plan's predicted mean: every host rate of the
  hardware profile that many times as long (`HardwareProfile.host_slower`);
- `alpha`: training's peak reserved over peak allocated bytes (CUDA; over the predicted peak where that is lower,
  runtime/replan.py `calibration_of`), in place of the profiling run's α. A model profiled on demand
  (`protrain_fx.prepare`) measures a higher one (its fetches fragment the allocator's cache as training does not),
  with which the search keeps too few chunks persistent;
- `forward`, `backward`: the compute's time in training over the profile's, one scale for the forward's compute
  (its recompute in the backward included) and one for the backward's, fitted (`fit_compute`) so that the plan in
  force's forward phase (with the wait for the host) and backward phase come out as the step monitor measured them
  on the device, from the forward graph's start to its end and from there to the backward graph's end (so not the
  training loop's own time between steps). A phase the compute does not explain (it hardly moves with it, or the
  fit leaves COMPUTE_SCALES) keeps its scale at 1;
- `offset_s`: what is left, training's step less the plan in force's as calibrated so far: the loop's own time
  and the error of what the model times outside the two phases (the device AdamW's part not hidden), added to
  every plan's step alike (`CostModel.step_offset_s`), so it moves no plan's rank, only the step predicted.

The plan in force and the calibrated search's best are compared as the search ranks plans (`ranked_step_s`), both
timed by the calibrated model; the best replaces the plan in force only where it is faster by more than
`switch_margin`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

from protrain_fx.planner.cost import Candidate, CostModel
from protrain_fx.planner.inputs import PlanningInputs, retimed
from protrain_fx.planner.plan import Plan, decisions
from protrain_fx.planner.search import SEARCHED, NoPlanFits, forced_counts, plan_graph, ranked_step_s, tie_rel

log = logging.getLogger(__name__)

# a switch recompiles the graph and may move chunks and their optimizer states between device and host: a plan
# predicted less than this much faster (or within the search's ties, where that is more) does not pay for it
SWITCH_MARGIN = 0.03
# where training measured α, a re-plan is searched under this share of the capacity less: α was measured under
# another plan, and a switch that moves chunks can neither be undone nor re-planned by on_oom if it runs out of memory
SWITCH_HEADROOM = 0.1
COMPUTE_SCALES = (1 / 3, 3.0)  # the compute scales `fit_compute` may find; a phase outside them is not the compute's
# the least share of a phase that must scale with the compute for a fit of its scale (the rest: copies, waits)
COMPUTE_SHARE = 0.5
FIT_STEPS = 20  # bisection steps of a scale's fit (COMPUTE_SCALES' ratio of 9 to within 0.001%)
FIT_ROUNDS = 3  # the forward's scale fitted, then the backward's, in turn


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What training measured, as scales of the cost model's terms (1.0 / None: as profiled)."""

    host: float = 1.0  # the host AdamW's seconds per parameter in training over the plan's prediction
    alpha: float | None = None  # training's peak reserved over peak allocated bytes (None: not measured, CPU)
    forward: float = 1.0  # the forward's compute time in training over the profile's (`fit_compute`)
    backward: float = 1.0  # the backward's
    offset_s: float = 0.0  # training's step less the plan in force's, calibrated (CostModel.step_offset_s)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        alpha = "α as profiled" if self.alpha is None else f"α {self.alpha:.3f}"
        return (
            f"the host AdamW {self.host:.2f}x as long as predicted, {alpha}, the compute {self.forward:.2f}x "
            f"(forward) and {self.backward:.2f}x (backward) as profiled, {self.offset_s * 1e3:+.1f} ms a step besides"
        )


def calibrated(costs: CostModel, calibration: Calibration) -> CostModel:
    """`costs` with the host's work, α and the compute as training measured them."""
    hardware = costs.hardware.host_slower(calibration.host) if calibration.host != 1.0 else costs.hardware
    alpha = costs.alpha if calibration.alpha is None else calibration.alpha
    again = dataclasses.replace(costs, hardware=hardware, alpha=alpha, step_offset_s=calibration.offset_s)
    return compute_scaled(again, calibration.forward, calibration.backward)


def compute_scaled(costs: CostModel, forward: float, backward: float) -> CostModel:
    """`costs` with the forward's compute (recompute included) `forward` times as long, the backward's `backward`."""
    if forward == backward == 1.0:
        return costs

    def scaled(times, by):
        return tuple(t * by for t in times)

    return dataclasses.replace(
        costs,
        block_fwd_s=scaled(costs.block_fwd_s, forward),
        other_fwd_s=scaled(costs.other_fwd_s, forward),
        block_selective_s=scaled(costs.block_selective_s, forward),
        block_bwd_s=scaled(costs.block_bwd_s, backward),
        other_bwd_s=scaled(costs.other_bwd_s, backward),
    )


def fit_compute(costs: CostModel, plan: Plan, forward_s: float, backward_s: float) -> tuple[float, float]:
    """The compute scales (forward, backward) under which `costs` times `plan`'s forward phase (with the wait for
    the host's updates, which a forward sits through on the device) at `forward_s` and its backward at
    `backward_s`, as training measured them; 1.0 for a phase the compute does not explain (module docstring)."""

    def phases(fwd: float, bwd: float) -> tuple[float, float]:
        return device_phases(compute_scaled(costs, fwd, bwd), plan)

    fwd = bwd = 1.0
    for _ in range(FIT_ROUNDS):  # (the forward's wait for the host depends on when the backward's updates ran)
        fwd = _fit(lambda scale: phases(scale, bwd)[0], forward_s)  # noqa: B023 (called at once, in the loop)
        bwd = _fit(lambda scale: phases(fwd, scale)[1], backward_s)  # noqa: B023
    return fwd, bwd


def _fit(phase_s, measured: float) -> float:
    """The scale in COMPUTE_SCALES at which the increasing `phase_s(scale)` is `measured`, by bisection over its
    logarithm; 1.0 where `measured` is outside its range or less than COMPUTE_SHARE of the phase scales."""
    lo, hi = COMPUTE_SCALES
    at_lo, at_one, at_hi = phase_s(lo), phase_s(1.0), phase_s(hi)
    if not at_lo <= measured <= at_hi or at_hi - at_lo < COMPUTE_SHARE * (hi - lo) * at_one:
        return 1.0
    for _ in range(FIT_STEPS):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if phase_s(mid) < measured else (lo, mid)
    return math.sqrt(lo * hi)


def switch_margin(costs: CostModel) -> float:
    """How much faster, as a share of the plan in force's ranked step, a plan must be predicted to switch to it."""
    return max(SWITCH_MARGIN, tie_rel(costs))


def searches(costs: CostModel, forced: Mapping[str, Any], layout) -> bool:
    """Whether `plan_graph` searches any field under `forced` (with every one forced it only times the plan)."""
    return not set(SEARCHED) <= set(forced_counts(costs, forced, layout))


def ranked_s(costs: CostModel, plan: Plan) -> float:
    """The plan's step time as the search ranks it (`ranked_step_s`), its block modes and gradient slots forced."""
    return ranked_step_s(_forcing_plan(costs, plan))(_candidate(plan))


def plan_step_s(costs: CostModel, plan: Plan, *, clipped: bool = False) -> float:
    """The plan's step time (`Timeline.step_s`; `clipped`: a step with clipping that does not apply), its block
    modes and gradient slots forced."""
    return _forcing_plan(costs, plan).step_s(_candidate(plan), plan.n_clip_overlap if clipped else None)


def plan_phases(costs: CostModel, plan: Plan) -> dict[str, float]:
    """The terms of the plan's step time (`Timeline.phases`: forward, backward, optimizer, the wait for the host),
    its block modes and gradient slots forced."""
    return _forcing_plan(costs, plan).phases(_candidate(plan))


def device_phases(costs: CostModel, plan: Plan) -> tuple[float, float]:
    """The plan's forward and backward phases as the step monitor measures them on the device: the forward with the
    wait for the host's updates it sits through, and the backward (runtime/monitor.py `measured_phases`)."""
    t = plan_phases(costs, plan)
    return t["forward_s"] + t["cpu_optim_wait_s"], t["backward_s"]


def _forcing_plan(costs: CostModel, plan: Plan) -> CostModel:
    """`costs` with the plan's block modes and gradient slots forced."""
    return dataclasses.replace(
        costs,
        forced_modes=tuple(plan.block_modes),
        forced_grad_slots=plan.host_grad_slots,
        forced_device_grad_slots=plan.device_grad_slots,
    )


def _candidate(plan: Plan) -> Candidate:
    return Candidate.of(plan)


@dataclasses.dataclass(frozen=True)
class Replan:
    """The calibrated search's plan beside the plan in force, both timed by the calibrated cost model."""

    plan: Plan  # the search's best
    before: Plan  # the plan in force, timed again
    ranked_s: float  # the best's step as ranked
    before_ranked_s: float
    margin: float  # `switch_margin`
    alone: bool = False  # no other plan fits the calibrated model: the plan in force (which runs) is the best

    @property
    def gain(self) -> float:
        """The share of the plan in force's ranked step the best saves."""
        return (self.before_ranked_s - self.ranked_s) / self.before_ranked_s

    @property
    def switches(self) -> bool:
        """Whether the best is another plan, faster by more than the margin."""
        return decisions(self.plan.to_json()) != decisions(self.before.to_json()) and self.gain > self.margin

    def to_json(self) -> dict[str, Any]:
        return {
            "switches": self.switches,
            "gain": self.gain,
            "margin": self.margin,
            "alone": self.alone,
            "ranked_s": self.ranked_s,
            "before_ranked_s": self.before_ranked_s,
            "plan": self.plan.to_json(),
            "before": self.before.to_json(),
        }


def replanned(
    costs: CostModel, inputs: PlanningInputs, plan: Plan, forced: Mapping[str, Any], *, headroom: float = 0.0
) -> Replan:
    """Search `costs` (calibrated) again with the fields `forced` under the capacities of `inputs` (the GPU's less
    the share `headroom`), and time the plan in force on it. Where no plan fits the calibrated model (a larger α,
    the headroom), the plan in force is the best: it runs, so it fits (`alone`)."""
    capacity = None if inputs.capacity_bytes is None else int(inputs.capacity_bytes * (1 - headroom))
    before = retimed(costs, inputs, plan, costs.hardware)
    try:
        best = plan_graph(costs, forced, inputs.layout, capacity, inputs.host_bytes)
    except NoPlanFits as error:
        log.info("no other plan fits the calibrated model: %s", str(error).splitlines()[0])
        ranked = ranked_s(costs, before)
        return Replan(before, before, ranked, ranked, switch_margin(costs), alone=True)
    return Replan(best, before, ranked_s(costs, best), ranked_s(costs, before), switch_margin(costs))
