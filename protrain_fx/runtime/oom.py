"""Out of GPU memory: an error that says what was planned and what to do, and the `on_oom="replan"` option.

Where an out-of-memory error can arise, and what each `on_oom` option does there:

    where                          "raise" (default)          "replan"
    building the chunks (compile)  the error below            search again under a lower capacity; build again
    a graph's forward              the error below            re-plan the graph under a lower capacity (the
                                                              chunks stay as built), recompile it, run the
                                                              forward again: the caller sees nothing but a
                                                              logged warning
    a graph's backward             the error below            the step is lost: its gradients are dropped, the
                                                              optimizer's next `step()` is skipped (logged, and
                                                              `last_step_skipped`), and the graph is re-planned
                                                              before its next forward
    the optimizer step             the error below            the error below

The error is a `torch.OutOfMemoryError` naming the graph, the plan in force, its predicted peak against the
capacity it was planned for, what the device held when it failed, and how to continue. A re-plan lowers the
capacity the planner assumes to `SHRINK` of the smaller of the last one and the device's own
(`device_capacity`); after `MAX_REPLANS` re-plans of one graph the error is raised. A backward cannot be lost
once an offloaded chunk's host update of that step has started (it changed the weights): that raises too.
Re-planning is for one process: with several ranks, the others are inside the step's collectives when one runs
out of memory, and cannot re-plan with it (that would take aborting and rebuilding the process group). There the
error is raised on that rank, says so, and the others stop at their next collective with the error of a rank
that died (distributed.py: `across_ranks`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from protrain_fx.config import ProTrainConfig
from protrain_fx.distributed import rank_and_world_size
from protrain_fx.profiler.hardware import device_capacity

log = logging.getLogger(__name__)

SHRINK = 0.9  # each re-plan assumes this share of the last capacity (or of the device's, when smaller)
MAX_REPLANS = 4  # per graph: 0.9**4, about two thirds of the first capacity


def _gib(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def plan_summary(plan: Any) -> str:
    """One line: the plan's decisions and its predicted peak."""
    if plan is None:
        return "no plan"
    sharded = f"n_device_shard={plan.n_device_shard} " if plan.n_device_shard else ""
    return (
        f"n_persist={plan.n_persist} {sharded}n_buffer={plan.n_buffer} of {plan.n_chunk} chunks, n_swap={plan.n_swap} "
        f"n_checkpoint={plan.n_checkpoint} n_selective={plan.n_selective} of {plan.n_block} blocks (predicted peak "
        f"{_gib(plan.predicted_peak_bytes)})"
    )


def device_state(device: torch.device) -> str:
    """What the device held when it failed (read inside the `except`, while the failed step's tensors live)."""
    if device.type != "cuda":
        return ""
    return (
        f"; allocated when it failed {_gib(torch.cuda.memory_allocated(device))}, the most allocated since the "
        f"last peak reset {_gib(torch.cuda.max_memory_allocated(device))}, device capacity "
        f"{_gib(device_capacity(device))}"
    )


def first_line(error: BaseException) -> str:
    return str(error).strip().split("\n")[0]


@dataclasses.dataclass
class Replanning:
    """One graph's out-of-memory policy and state: the config it plans with (`gpu_memory_bytes` lowered at each
    re-plan) and the re-plans so far. `due`: a backward ran out of memory, re-plan before the next forward."""

    config: ProTrainConfig
    device: torch.device
    replans: int = 0
    due: bool = False

    @property
    def enabled(self) -> bool:
        return self.config.on_oom == "replan"

    def _next_capacity(self, assumed: int | None) -> int | None:
        """SHRINK of the smaller of `assumed` (what the last plan was searched under) and the device's capacity;
        None with neither (the CPU without `gpu_memory_bytes`)."""
        limits = [c for c in (assumed, device_capacity(self.device)) if c]
        return int(min(limits) * SHRINK) if limits else None

    def lower(self, assumed: int | None) -> bool:
        """Lower the capacity for the next plan; False when re-planning is off, spent, or has no capacity to
        lower."""
        capacity = self._next_capacity(assumed)
        if not self.enabled or self.replans >= MAX_REPLANS or capacity is None or rank_and_world_size()[1] > 1:
            return False
        self.replans += 1
        self.config = dataclasses.replace(self.config, gpu_memory_bytes=capacity)
        log.warning("out of GPU memory: re-plan %d of at most %d, under %s", self.replans, MAX_REPLANS, _gib(capacity))
        return True

    def error(self, where: str, graph: int, plan: Any, assumed: int | None, state: str, cause: str, *, why=""):
        """The OutOfMemoryError to raise: what ran out, under which plan, and what to do."""
        lower = self._next_capacity(assumed)
        advice = "a smaller gpu_memory_bytes" if lower is None else f"options={{'gpu_memory_bytes': {lower}}}"
        advice += " plans for less memory from the start"
        rank, world = rank_and_world_size()
        if self.enabled and world > 1:
            todo = (
                f"on_oom='replan' re-plans a single process only (this is rank {rank} of {world}; the others are "
                "inside this step's collectives and stop at their next one): restart every rank from the last "
                f"checkpoint; {advice}, or force more headroom (options={{'plan': {{'n_checkpoint': ..., "
                "'n_persist': ...}})"
            )
        elif self.enabled:
            what = why or f"re-planned {self.replans} times down to {_gib(self.config.gpu_memory_bytes)}"
            todo = (
                f"{what}; {advice}, or force more headroom (options={{'plan': {{'n_checkpoint': ..., 'n_persist': "
                "...}}), a smaller batch, or more GPUs"
            )
        else:
            todo = (
                f"options={{'on_oom': 'replan'}} re-plans with less memory and goes on; {advice}; or force a plan "
                "with more headroom (options={'plan': {'n_checkpoint': ..., 'n_persist': ...}})"
            )
        return torch.OutOfMemoryError(
            f"protrain: the {where} of graph {graph} ran out of GPU memory under the plan {plan_summary(plan)}, "
            f"planned for a capacity of {_gib(assumed)}{state}. To continue: {todo}.\n(torch: {cause})"
        )
