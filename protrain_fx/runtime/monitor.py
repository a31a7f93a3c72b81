"""StepMonitor: measured step time and peak memory of a compiled graph, set beside the plan's predictions.

A training graph's forward starts with `protrain.step_mark(monitor, x, sizes)` (with a dump directory, or where the
closed loop re-plans it: runtime/replan.py): each call is one training step's start. After `warmup` steps it starts
measuring (CUDA's peak memory counters are reset then), and after `steps` more it keeps its `report` (for the
closed loop) and, with a dump directory, writes it as `predicted_vs_measured.json` next to `plan.json` (after a
re-plan `replanned_vs_measured.json`, next to `replan.json`): the predicted and measured step time
(the median time between forward starts, on CUDA by events on the compute stream; a graph with symbolic sizes
passes each step's sizes to `step_mark`, and each step's time is scaled by the plan's predicted time at the
planned sizes over its predicted time at the step's: `step_sizes` in the report), peak allocated bytes and peak
reserved bytes (CUDA only; the CPU has no allocator to ask), with their relative errors. The step time of a model
whose gradients are clipped (`protrain_fx.clip_grad_norm_`) is set beside the plan's `predicted_clipped_step_s`,
a step whose clip does not apply (`"clipped": true`); one whose clip applies defers every update to
`AdamW.step()`, which no prediction times. Where chunks are offloaded, also the host AdamW's median seconds per
parameter over the measured steps' updates, beside the plan's predicted mean over its updates (at the rates
beside the copies the cost model put there) and the hardware profile's figures for the plan's master dtype (alone
and beside copies both ways) the plan was timed with; on CUDA a rate far outside those figures is logged as a
warning: the profile, cached and reused, may have been measured while the machine was busy. Given how to time
the plan again (`retime`: planner/inputs.py `retimed`), also the plan's step time with the host's work scaled by
the measured over the predicted rate (`host_scale`), and its error: what is left of the error is not the host's
rate. The forward graph's end and the backward graph's end are marked too (`protrain.phase_mark`): the report
has the median forward phase (its start to its end) and backward phase (the forward's end to the backward's end)
on the device's clock, beside the plan's predicted ones where given, which the closed loop fits the compute to
(planner/calibrate.py `fit_compute`).
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from protrain_fx.cache_dir import default_cache_dir
from protrain_fx.passes.monitor import BACKWARD_END, FORWARD_END
from protrain_fx.planner.plan import MASTER_BYTES, Plan
from protrain_fx.runtime import ops

if TYPE_CHECKING:
    from protrain_fx.profiler.hardware import HardwareProfile

log = logging.getLogger(__name__)


WARMUP_STEPS = 2  # steps before measuring (compile, first-use costs)
MEASURED_STEPS = 5
REPORT_FILE = "predicted_vs_measured.json"
# the host AdamW in training may run this much faster than the hardware profile's figure alone, or slower than
# its figure beside copies both ways, before the profile is suspect (the host's rate varies between runs on one
# machine, so a tighter bound would warn of ordinary runs)
HOST_RATE_SLACK = 1.5


class StepMonitor:
    def __init__(
        self,
        device: torch.device,
        plan: Plan,
        dumper,
        *,
        manager=None,
        hardware: HardwareProfile | None = None,
        retime: Callable[[HardwareProfile], Plan] | None = None,
        phases: Callable[[], tuple[float, float]] | None = None,
        at_sizes: Callable[[tuple[int, ...], bool], tuple[float, float, float]] | None = None,
        warmup: int = WARMUP_STEPS,
        steps: int = MEASURED_STEPS,
        report_file: str = REPORT_FILE,
    ):
        """`dumper`: where the report is written (None: kept only); `manager`: the model's ChunkManager (held
        weakly), whose host updates are timed; `hardware`: the profile the plan was timed with; `retime`: the plan
        timed again on another hardware profile; `phases`: the plan's predicted forward and backward phases
        (planner/calibrate.py `device_phases`); `at_sizes`: for a graph with symbolic sizes, the plan's predicted
        step, forward and backward at a step's sizes (its `SymInt` inputs, in order; whether clipped), by which
        each measured step is scaled to the sizes the plan was made for (`_scales`)."""
        self.device = torch.device(device)
        self.plan, self.dumper, self.hardware, self.retime = plan, dumper, hardware, retime
        self.phases, self.at_sizes = phases, at_sizes
        self.sizes: list[tuple[int, ...]] = []  # each step's sizes (a graph with symbolic sizes)
        self.clipped = False  # whether the measured steps clipped (their predictions are the clipped step's)
        self.manager = weakref.ref(manager) if manager is not None else lambda: None
        self.warmup, self.steps, self.report_file = warmup, steps, report_file
        self.marks: list = []
        # FORWARD_END, BACKWARD_END -> {step: its mark}, over the measured steps
        self.phase_marks: dict[int, dict[int, object]] = {FORWARD_END: {}, BACKWARD_END: {}}
        self.report: dict | None = None  # what the measured steps showed, once they are over
        self.handle = ops.register(self)

    def mark(self, sizes: tuple[int, ...] = ()) -> None:
        if len(self.marks) > self.warmup + self.steps:
            return
        self.sizes.append(tuple(sizes))
        cuda = self.device.type == "cuda"
        if len(self.marks) == self.warmup:
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            if (manager := self.manager()) is not None:
                manager.host_updates.timings.clear()
        self.marks.append(self._now())
        if len(self.marks) == self.warmup + self.steps + 1:
            self._write()

    def phase_mark(self, phase: int) -> None:
        """The end of this step's forward graph (FORWARD_END) or backward graph (BACKWARD_END), while measuring."""
        step = len(self.marks) - 1
        if self.warmup <= step < self.warmup + self.steps:
            self.phase_marks[phase][step] = self._now()

    def _now(self):
        """A mark: an event on the current stream (CUDA), or the time."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _scales(self) -> dict[int, tuple[float, float, float]]:
        """Step -> what its measured step, forward and backward are multiplied by to stand at the sizes the plan
        was made for: the plan's predicted time there over its predicted time at the step's own sizes (1 where
        the graph's sizes are fixed). Steps of different sizes are then measured against one prediction, so the
        closed loop calibrates on them as on steps of one size."""
        steps = range(self.warmup, self.warmup + self.steps)
        if self.at_sizes is None:
            return dict.fromkeys(steps, (1.0, 1.0, 1.0))
        planned = self.at_sizes((), self.clipped)
        at: dict[tuple[int, ...], tuple[float, float, float]] = {}
        for step in steps:
            if self.sizes[step] not in at:
                at[self.sizes[step]] = self.at_sizes(self.sizes[step], self.clipped)
        return {step: tuple(p / q for p, q in zip(planned, at[self.sizes[step]])) for step in steps}

    def measured(self) -> tuple[float, int | None]:
        """(median seconds per step, at the planned sizes (`_scales`), and peak allocated bytes or None) over the
        measured steps (the median: one step slowed by something outside training, a host hiccup, does not move
        it)."""
        marks = self.marks[self.warmup :]
        scales = self._scales()
        if self.device.type == "cuda":
            marks[-1].synchronize()
            steps = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            steps = [b - a for a, b in zip(marks, marks[1:])]
        steps = [t * scales[self.warmup + i][0] for i, t in enumerate(steps)]
        return statistics.median(steps), torch.cuda.max_memory_allocated(
            self.device
        ) if self.device.type == "cuda" else None

    def measured_phases(self) -> tuple[float, float] | None:
        """(median seconds of the forward graph, median seconds from its end to the backward graph's end) over the
        measured steps that marked both (None where none did), on the device's clock; after `measured`, which
        waits for the device."""
        ends = self.phase_marks
        steps = [i for i in ends[BACKWARD_END] if i in ends[FORWARD_END]]
        if not steps:
            return None

        def seconds(a, b) -> float:
            return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a

        scales = self._scales()
        forward = [seconds(self.marks[i], ends[FORWARD_END][i]) * scales[i][1] for i in steps]
        backward = [seconds(ends[FORWARD_END][i], ends[BACKWARD_END][i]) * scales[i][2] for i in steps]
        return statistics.median(forward), statistics.median(backward)

    def measured_reserved(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else None

    def _write(self) -> None:
        plan = self.plan
        manager = self.manager()
        clipped = self.clipped = manager is not None and manager.clip_norm_type is not None
        step_s, peak = self.measured()
        predicted = plan.predicted_clipped_step_s if clipped else plan.predicted_step_s

        def error(predicted, measured):
            return None if predicted is None or not measured else (predicted - measured) / measured

        report = {
            "steps": self.steps,
            "clipped": clipped,
            "predicted_step_s": predicted,
            "measured_step_s": step_s,
            "step_error": error(predicted, step_s),
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "measured_peak_bytes": peak,
            "peak_error": error(plan.predicted_peak_bytes, peak),
            "predicted_reserved_bytes": plan.predicted_reserved_bytes,
            "measured_reserved_bytes": self.measured_reserved(),
            "reserved_error": error(plan.predicted_reserved_bytes, self.measured_reserved()),
        }
        if self.at_sizes is not None:  # (steps of several sizes, each scaled to the planned sizes)
            report["step_sizes"] = [list(self.sizes[i]) for i in range(self.warmup, self.warmup + self.steps)]
        phases = self.measured_phases()
        if phases is not None:
            report["measured_forward_s"], report["measured_backward_s"] = phases
        if self.phases is not None:
            report["predicted_forward_s"], report["predicted_backward_s"] = self.phases()
        report.update(self._host_adam())
        scale = host_scale(report)
        if scale is not None and self.retime is not None:
            again = self.retime(self.hardware.host_slower(scale))
            at_host = again.predicted_clipped_step_s if clipped else again.predicted_step_s
            report["predicted_step_s_at_measured_host"] = at_host
            report["step_error_at_measured_host"] = error(at_host, step_s)
        self.report = report
        if self.dumper:
            self.dumper.write_json(self.report_file, report)
        log.info("predicted vs measured: %s", report)

    def _host_adam(self) -> dict:
        """The host AdamW's measured and profiled seconds per parameter (none without offloaded updates)."""
        manager = self.manager()
        updates = tuple(manager.host_updates.timings) if manager is not None else ()  # (the worker thread appends)
        if not updates or self.hardware is None:
            return {}
        measured = statistics.median(seconds / params for params, seconds in updates)
        master = MASTER_BYTES[self.plan.master_dtype]  # (bfloat16 masters update at their own rate)
        alone, both = self.hardware.host_adam_s(False, False, master), self.hardware.host_adam_s(True, True, master)
        if self.device.type == "cuda" and not alone / HOST_RATE_SLACK <= measured <= both * HOST_RATE_SLACK:
            log.warning(
                "the host AdamW took %.3g s/param in training; the hardware profile the plan was timed with has "
                "%.3g alone and %.3g beside copies both ways, so its predictions are off. If the profile was "
                "measured while the machine was busy, measure it again: delete the cached profiles under %s",
                measured,
                alone,
                both,
                default_cache_dir() / "hardware",
            )
        return {
            "measured_host_adam_s_per_param": measured,
            "predicted_host_adam_s_per_param": self.plan.predicted_host_adam_s_per_param,
            "profiled_host_adam_s_per_param": [alone, both],
        }


def host_scale(report: dict) -> float | None:
    """How many times as long the host AdamW took in training as the plan's prediction had it, from a
    predicted_vs_measured.json report; None where it has no measured or predicted rate (nothing offloaded, or a
    report written before the prediction was kept). The prediction is the unclipped step's: a clipped run's
    updates during the backward also copy aside what they change, which counts as a slower host here."""
    measured, predicted = report.get("measured_host_adam_s_per_param"), report.get("predicted_host_adam_s_per_param")
    return measured / predicted if measured and predicted else None
