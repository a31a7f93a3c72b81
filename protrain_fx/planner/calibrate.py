"""Calibration: the cost model fitted again to what training measured, and whether the search then finds a plan
enough faster than the one in force to switch to it (the closed loop: runtime/replan.py).

    calibration = Calibration(host=1.5, alpha=1.12)       # training's, the largest any rank measured
    costs = calibrated(record.costs, calibration)
    replan = replanned(costs, record.planning, record.plan, forced)
    if replan.switches: ...                               # put replan.plan in force

What is fitted again:
- `host`: training's host AdamW seconds per parameter over the plan's predicted mean: every host rate of the
  hardware profile that many times as long (`HardwareProfile.host_slower`);
- `alpha`: training's peak reserved over peak allocated bytes (CUDA; over the predicted peak where that is lower,
  runtime/replan.py `calibration_of`), in place of the profiling run's α. A model profiled on demand
  (`protrain_fx.prepare`) measures a higher one (its fetches fragment the allocator's cache as training does not),
  with which the search keeps too few chunks persistent.
Not the compute: the step time measured runs from one forward's start to the next, so it holds the training
loop's own time (data, logging, the optimizer call) and the host's wait, which no one compute scale tells from the
device's work (docs/limitations.md).

The plan in force and the calibrated search's best are compared as the search ranks plans (`ranked_step_s`), both
timed by the calibrated model; the best replaces the plan in force only where it is faster by more than
`switch_margin`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from protrain_fx.planner.cost import Candidate, CostModel
from protrain_fx.planner.inputs import PlanningInputs, retimed
from protrain_fx.planner.plan import Plan, decisions
from protrain_fx.planner.search import SEARCHED, plan_graph, ranked_step_s, tie_rel

# a switch recompiles the graph and may move chunks and their optimizer states between device and host: a plan
# predicted less than this much faster (or within the search's ties, where that is more) does not pay for it
SWITCH_MARGIN = 0.03
# where training measured α, a re-plan is searched under this share of the capacity less: α was measured under
# another plan, and a switch that moves chunks can neither be undone nor re-planned by on_oom if it runs out of memory
SWITCH_HEADROOM = 0.1


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What training measured, as scales of the cost model's terms (1.0 / None: as profiled)."""

    host: float = 1.0  # the host AdamW's seconds per parameter in training over the plan's prediction
    alpha: float | None = None  # training's peak reserved over peak allocated bytes (None: not measured, CPU)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        alpha = "α as profiled" if self.alpha is None else f"α {self.alpha:.3f}"
        return f"the host AdamW {self.host:.2f}x as long as predicted, {alpha}"


def calibrated(costs: CostModel, calibration: Calibration) -> CostModel:
    """`costs` with the host's work and α as training measured them."""
    hardware = costs.hardware.host_slower(calibration.host) if calibration.host != 1.0 else costs.hardware
    alpha = costs.alpha if calibration.alpha is None else calibration.alpha
    return dataclasses.replace(costs, hardware=hardware, alpha=alpha)


def switch_margin(costs: CostModel) -> float:
    """How much faster, as a share of the plan in force's ranked step, a plan must be predicted to switch to it."""
    return max(SWITCH_MARGIN, tie_rel(costs))


def searches(costs: CostModel, forced: Mapping[str, Any], layout) -> bool:
    """Whether `plan_graph` searches any field under `forced` (with every one forced it only times the plan)."""
    held = set(forced) & set(SEARCHED)
    if "block_modes" in forced:
        held |= {"n_swap", "n_checkpoint", "n_selective"}
    if not costs.prices_selective:
        held.add("n_selective")
    if layout is None or forced.get("n_persist") == layout.n_chunk:
        held.add("n_buffer")
    if layout is None:
        held.add("n_persist")
    return not set(SEARCHED) <= held


def ranked_s(costs: CostModel, plan: Plan) -> float:
    """The plan's step time as the search ranks it (`ranked_step_s`), its block modes and gradient slots held."""
    held = dataclasses.replace(
        costs,
        forced_modes=tuple(plan.block_modes),
        grad_slots_held=plan.host_grad_slots,
        device_grad_slots_held=plan.device_grad_slots,
    )
    return ranked_step_s(held)(Candidate(*(getattr(plan, k) for k in SEARCHED)))


@dataclasses.dataclass(frozen=True)
class Replan:
    """The calibrated search's plan beside the plan in force, both timed by the calibrated cost model."""

    plan: Plan  # the search's best
    before: Plan  # the plan in force, timed again
    ranked_s: float  # the best's step as ranked
    before_ranked_s: float
    margin: float  # `switch_margin`

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
            "ranked_s": self.ranked_s,
            "before_ranked_s": self.before_ranked_s,
            "plan": self.plan.to_json(),
            "before": self.before.to_json(),
        }


def replanned(
    costs: CostModel, inputs: PlanningInputs, plan: Plan, forced: Mapping[str, Any], *, headroom: float = 0.0
) -> Replan:
    """Search `costs` (calibrated) again with the fields `forced` under the capacities of `inputs` (the GPU's less
    the share `headroom`), and time the plan in force on it. Raises NoPlanFits where nothing fits the calibrated
    model."""
    capacity = None if inputs.capacity_bytes is None else int(inputs.capacity_bytes * (1 - headroom))
    best = plan_graph(costs, forced, inputs.layout, capacity, inputs.host_bytes)
    before = retimed(costs, inputs, plan, costs.hardware)
    return Replan(best, before, ranked_s(costs, best), ranked_s(costs, before), switch_margin(costs))
