"""The closed loop: once a training graph's step monitor has measured its steps (runtime/monitor.py), the cost model
is calibrated to what training measured (planner/calibrate.py: the host AdamW's rate, and on CUDA the reserved over
allocated bytes and the compute's time in the forward and backward phases) and searched again under the same
forced fields and capacities; a plan predicted faster than the plan in force by more than the switch's margin goes
into force between two steps, once per graph, on every rank alike:

    forward of step k          the monitor's report is in (WARMUP_STEPS + MEASURED_STEPS steps after the compile)
    forward of step k + 1      `ClosedLoop.decide`: the calibration (the largest on any rank, so every rank searches
                               alike) and the search; with chunks, wait for a forward that starts between two steps
                               on every rank (not between the backward passes of an accumulated step)
    then                       `ChunkPlacement.place_again` where the chunk fields change; the graph compiled again
                               with the new plan from its stored profile (backend/guard.py `Guarded`)

The chunk fields change only where the graph is the only one that reads the model's chunks and ends in no graph
break (the others, or the Python after the break, were built for the chunks where they are); elsewhere they are held
and the activation fields alone searched.

Plans in turn (the `replan` option as a list of plan-field dicts, to compare plans in one run on one machine): the
calibration and decision as above, then each turn's plan (the first compile's search with its fields forced, so the
plan a run forcing them trains; `{}`: the plan the loop keeps in force) switched to the same way, each once the plan
before it has measured its steps, and every plan's report kept in replan.json ("turns").
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from protrain_fx.distributed import most_on_every_rank
from protrain_fx.planner.calibrate import (
    SWITCH_HEADROOM,
    Calibration,
    Replan,
    calibrated,
    compute_scaled,
    fit_compute,
    plan_step_s,
    replanned,
    searches,
)
from protrain_fx.planner.cost import CostModel
from protrain_fx.planner.plan import Plan, decisions
from protrain_fx.planner.search import NoPlanFits, plan_graph
from protrain_fx.runtime.adopt import plan_fields_of
from protrain_fx.runtime.monitor import host_scale

log = logging.getLogger(__name__)

REPLAN_FILE = "replan.json"  # in a dump: the calibration, the plan in force and the search's, and the decision
REPLANNED_REPORT = "replanned_vs_measured.json"  # the step monitor's report of the plan switched to
# forwards a switch waits for one that starts between two steps before it is given up: a loop that holds gradients
# at every forward (zeroing them between forward and backward) never gets there, and each wait is an all-reduce
MAX_WAITS = 16
# the devices whose measured phases the compute is fitted to (`compute_of`): on the CPU, the "device" is the host and
# its profile's timings move between runs by more than a fit would correct
FIT_COMPUTE_ON = ("cuda",)


def calibration_of(report: dict) -> Calibration:
    """What a step monitor's report measured: the host AdamW's rate over the plan's, and on CUDA the peak reserved
    over the peak allocated bytes, or over the predicted peak where that is lower (so that the plan in force is
    predicted to reserve at least what training reserved: the peak's own error is not α's to hide)."""
    reserved, peak = report.get("measured_reserved_bytes"), report.get("measured_peak_bytes")
    predicted = report.get("predicted_peak_bytes") or peak
    alpha = reserved / min(peak, predicted) if reserved and peak else None
    return Calibration(host=host_scale(report) or 1.0, alpha=alpha)


def compute_of(report: dict, costs: CostModel, plan: Plan, device: torch.device) -> tuple[float, float, float]:
    """The compute scales (forward, backward) fitted to the phases a step monitor's report measured (`fit_compute`
    over `costs`, the host and α calibrated already), and the measured step less the plan's predicted then (its
    `offset_s`); (1.0, 1.0, 0.0) where no phases were measured or the device is not fitted."""
    forward, backward = report.get("measured_forward_s"), report.get("measured_backward_s")
    if device.type not in FIT_COMPUTE_ON or not forward or not backward:
        return 1.0, 1.0, 0.0
    forward, backward = fit_compute(costs, plan, forward, backward)
    predicted = plan_step_s(compute_scaled(costs, forward, backward), plan, clipped=report.get("clipped", False))
    return forward, backward, report["measured_step_s"] - predicted


def moves_chunks(plan: Plan, manager) -> bool:
    """Whether putting `plan` in force changes where the model's chunks are, or their gradient buffers."""
    n_buffer = manager.n_buffer if manager.n_persist < manager.layout.n_chunk else 0
    storage = manager.storage
    now = (manager.n_persist, storage.n_device_shard, n_buffer, storage.grad_slots, storage.device_grad_slots)
    return now != (plan.n_persist, plan.n_device_shard, plan.n_buffer, plan.host_grad_slots, plan.device_grad_slots)


@dataclasses.dataclass
class ClosedLoop:
    """One training graph's closed loop (module docstring): decided once, then done. With `turns` (the `replan`
    option as a list), after the first plan's measured steps each turn's plan goes into force for its own, and
    `measured` keeps every plan's report."""

    device: torch.device
    turns: list[dict] | None = None  # plan fields forced for each plan in turn, those not yet in force
    calibration: Calibration | None = None
    costs: CostModel | None = None  # the calibrated cost model
    replan: Replan | None = None  # the search's decision, made once the report is in
    first: tuple[Plan, CostModel] | None = None  # the first plan and the cost model it was searched with
    pending: tuple[Plan, CostModel] | None = None  # what to put in force at the first forward between two steps
    reason: str = ""  # why the last switch was made, for its log line
    measured: list[dict] = dataclasses.field(default_factory=list)  # with turns: each plan's fields and report
    done: bool = False
    switched: bool = False
    waits: int = 0  # forwards the switch waited for the chunks to be between two steps
    # each switch's cost: the seconds placing the chunks again and compiling the forward again took (the backward
    # compiles at its first call)
    switches_s: list[dict] = dataclasses.field(default_factory=list)

    def resume(self, calibration: Calibration, costs: CostModel, *, switched: bool) -> None:
        """Take an earlier run's decision as this loop's (the plan cache, backend/cache.py): calibrated as it was,
        `costs` the calibrated cost model, the plan it chose in force from the start; nothing more to measure."""
        self.calibration, self.costs, self.switched, self.done = calibration, costs, switched, True

    def decision(self) -> tuple[Calibration, bool] | None:
        """The loop's decision, to keep for the next run: (its calibration, whether it switched); None where it made
        none (plans in turn, not decided yet, or given up waiting for a forward between two steps)."""
        if self.turns is not None or self.calibration is None or not self.done or self.pending is not None:
            return None
        return self.calibration, self.switched

    def watches(self, record) -> bool:
        """Whether the graph needs its steps measured: the loop is not done, and its plan has fields left to search
        (a plan with every field forced is done at once) or plans to run in turn."""
        if self.done or record.costs is None or record.planning is None:
            return False
        if record.fit is not None and self.turns is not None:  # (symbolic sizes: no plan is put in force here)
            log.warning("graph %d has symbolic sizes: the 'replan' option's plans in turn are not run", record.index)
            self.done = True
            return False
        self.done = self.turns is None and not searches(record.costs, record.planning.forced, record.planning.layout)
        return not self.done

    def due(self, monitor) -> bool:
        """Whether the graph's monitor has measured its steps and the loop is not done."""
        return not self.done and monitor is not None and monitor.report is not None

    def decide(self, record, manager, chunks_may_move: bool) -> tuple[Plan, CostModel] | None:
        """The plan to put in force now, with the cost model that times it, else None: none worth switching to or
        none left to run in turn (the loop is done), or none yet, a step of the model's chunks being under way on
        some rank (gradients accumulating: asked again at the next forward, MAX_WAITS times at most)."""
        if self.pending is None:
            self.pending = self._next(record, manager, chunks_may_move)
            if self.pending is None:
                self.done = True
                return None
        if manager is not None and max(
            most_on_every_rank([0.0 if manager.placement.between_steps else 1.0], self.device)
        ):
            self.waits += 1
            if self.waits >= MAX_WAITS:
                log.info("graph %d: no re-plan, no forward in %d started between two steps", record.index, MAX_WAITS)
                self.done = True
            return None
        switch, self.pending, self.waits = self.pending, None, 0
        self.switched = True
        self.done = self.turns is None  # (in turn: done once the last plan's report is in)
        return switch

    def _next(self, record, manager, chunks_may_move: bool) -> tuple[Plan, CostModel] | None:
        """The plan to switch to once the plan in force has measured its steps: the calibrated search's where it is
        enough faster, or with turns the next turn's; None where there is none."""
        if self.calibration is None:
            self.first = record.plan, record.costs
            self.replan = self._calibrated_search(record, manager, chunks_may_move)
            if self.turns is not None:
                plan = decisions(record.plan.to_json())
                self.measured.append({"forced": dict(record.planning.forced), "plan": plan})
        if self.turns is None:
            if not self.replan.switches:
                return None
            self.reason = f"from what training measured ({self.calibration}): {_switch(self.replan)}"
            return self.replan.plan, self.costs
        self.measured[-1]["report"] = record.monitor.report
        while self.turns:
            turn = self.turns.pop(0)
            switch = self._turn(turn, record, manager, chunks_may_move)
            self.measured.append({"forced": turn, "plan": decisions(switch[0].to_json()) if switch else None})
            if switch is not None:
                self.reason = f"in turn (the 'replan' option's plan {len(self.measured) - 1}, forcing {turn})"
                return switch
        return None

    def _turn(self, turn: dict, record, manager, chunks_may_move: bool) -> tuple[Plan, CostModel] | None:
        """One turn's plan as the graph's first compile would have searched it with those fields forced over its
        own (its cost model, capacities and predictions: so a turn is the plan a run forcing them trains); `{}`:
        the plan the closed loop keeps in force. None where no plan with those fields fits (logged)."""
        if not turn:
            return (self.replan.plan, self.costs) if self.replan.switches else self.first
        forced = {**record.planning.forced, **turn}
        if manager is not None and not chunks_may_move:
            forced = plan_fields_of(manager, forced)
        costs, inputs = self.first[1], record.planning
        try:
            return plan_graph(costs, forced, inputs.layout, inputs.capacity_bytes, inputs.host_bytes), costs
        except NoPlanFits as error:
            log.warning(
                "graph %d: no plan forcing %s fits (%s); that turn is skipped",
                record.index,
                turn,
                str(error).splitlines()[0],
            )
            return None

    def _calibrated_search(self, record, manager, chunks_may_move: bool) -> Replan:
        """The calibrated search's plan beside the plan in force (the plan in force alone where nothing is
        searched)."""
        report = record.monitor.report
        mine = calibration_of(report)
        host, alpha = most_on_every_rank([mine.host, mine.alpha or 0.0], self.device)
        measured = calibrated(record.costs, Calibration(host=host, alpha=alpha or None))
        forward, backward, offset = most_on_every_rank(
            list(compute_of(report, measured, record.plan, self.device)), self.device
        )
        self.calibration = Calibration(
            host=host, alpha=alpha or None, forward=forward, backward=backward, offset_s=offset
        )
        forced = dict(record.planning.forced)
        if manager is not None and not chunks_may_move:
            forced = plan_fields_of(manager, forced)
        self.costs = calibrated(record.costs, self.calibration)
        if not searches(self.costs, forced, record.planning.layout):  # (only plans in turn to run)
            forced = decisions(record.plan.to_json())
        headroom = SWITCH_HEADROOM if self.calibration.alpha is not None else 0.0
        replan = replanned(self.costs, record.planning, record.plan, forced, headroom=headroom)
        log.info(
            "graph %d calibrated to training (%s; the plan in force now predicted at %.1f ms a step, measured "
            "%.1f ms): %s",
            record.index,
            self.calibration,
            replan.before.predicted_step_s * 1e3,
            report["measured_step_s"] * 1e3,
            _decision(replan),
        )
        return replan

    def not_placed(self) -> None:
        """The switch just decided could not place the chunks (no room on a rank): the plan in force stays, and the
        loop is done."""
        self.done = True
        if self.turns is None:
            self.switched = False
        else:
            self.measured[-1]["error"] = "no room to place the chunks"

    def note_switch(self, *, placed_s: float, compiled_s: float) -> None:
        """The switch just made took `placed_s` to place the chunks again and `compiled_s` to compile the forward."""
        took = {"placed_s": placed_s, "compiled_s": compiled_s}
        self.switches_s.append(took)
        if self.turns is not None:
            self.measured[-1]["switch_s"] = took

    def to_json(self) -> dict:
        """replan.json."""
        return {
            "calibration": self.calibration.to_json() if self.calibration else None,
            "switched": self.switched,
            "switches_s": self.switches_s,
            **(self.replan.to_json() if self.replan else {}),
            **({"turns": self.measured} if self.turns is not None else {}),
        }


def _switch(replan: Replan) -> str:
    return (
        f"the calibrated search's plan is predicted at {replan.plan.predicted_step_s * 1e3:.2f} ms a step "
        f"({replan.ranked_s * 1e3:.2f} ms as ranked), the plan in force at {replan.before.predicted_step_s * 1e3:.2f} "
        f"ms ({replan.before_ranked_s * 1e3:.2f} ms as ranked): {replan.gain * 100:.1f}% faster, over the "
        f"{replan.margin * 100:.1f}% a switch needs"
    )


def _decision(replan: Replan) -> str:
    if replan.alone:
        return "no other plan fits the calibrated model: kept"
    return (
        f"the search's plan is predicted {abs(replan.gain) * 100:.1f}% {'faster' if replan.gain >= 0 else 'slower'} "
        f"as ranked than the plan in force (switches where faster by more than {replan.margin * 100:.1f}%): "
        f"{'switching' if replan.switches else 'kept'}"
    )
