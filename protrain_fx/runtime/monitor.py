"""StepMonitor: measured step time and peak memory of a compiled graph, set beside the plan's predictions.

With a dump directory, the forward graph starts with `protrain.step_mark(monitor, x)`: each call is one training
step's start. After `warmup` steps it starts measuring (the peak memory counter is reset then), and after
`steps` more it writes `predicted_vs_measured.json` next to `plan.json`: the predicted and measured step time
(the median time between forward starts, on CUDA by events on the compute stream), peak allocated bytes and peak
reserved bytes (CUDA only; the CPU has no allocator to ask), with their relative errors.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from protrain_fx.planner.plan import Plan
from protrain_fx.runtime import ops

log = logging.getLogger(__name__)


WARMUP_STEPS = 2  # steps before measuring (compile, first-use costs)
MEASURED_STEPS = 5


class StepMonitor:
    def __init__(
        self, device: torch.device, plan: Plan, dumper, *, warmup: int = WARMUP_STEPS, steps: int = MEASURED_STEPS
    ):
        self.device = torch.device(device)
        self.plan, self.dumper = plan, dumper
        self.warmup, self.steps = warmup, steps
        self.marks: list = []
        self.handle = ops.register(self)

    def mark(self) -> None:
        if len(self.marks) > self.warmup + self.steps:
            return
        cuda = self.device.type == "cuda"
        if len(self.marks) == self.warmup and cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        if len(self.marks) == self.warmup + self.steps + 1:
            self._write()

    def measured(self) -> tuple[float, int | None]:
        """(median seconds per step, peak allocated bytes or None) over the measured steps (the median: one step
        slowed by something outside training, a host hiccup, does not move it)."""
        marks = self.marks[self.warmup :]
        if self.device.type == "cuda":
            marks[-1].synchronize()
            steps = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
            return statistics.median(steps), torch.cuda.max_memory_allocated(self.device)
        return statistics.median(b - a for a, b in zip(marks, marks[1:])), None

    def measured_reserved(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else None

    def _write(self) -> None:
        step_s, peak = self.measured()
        plan = self.plan

        def error(predicted, measured):
            return None if predicted is None or not measured else (predicted - measured) / measured

        report = {
            "steps": self.steps,
            "predicted_step_s": plan.predicted_step_s,
            "measured_step_s": step_s,
            "step_error": error(plan.predicted_step_s, step_s),
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "measured_peak_bytes": peak,
            "peak_error": error(plan.predicted_peak_bytes, peak),
            "predicted_reserved_bytes": plan.predicted_reserved_bytes,
            "measured_reserved_bytes": self.measured_reserved(),
            "reserved_error": error(plan.predicted_reserved_bytes, self.measured_reserved()),
        }
        self.dumper.write_json("predicted_vs_measured.json", report)
        log.info("predicted vs measured: %s", report)
