"""Timing waits until the processes this one started have gone quiet.

`torch.compile` starts inductor's compile workers as it begins to compile a graph with CUDA inputs
(`AsyncCompile.wakeup()` in `compile_fx`): a sidecar process and a pool of workers under it (by default one per
core), each importing torch, which takes seconds of every core. Profiling runs inside that compile. A timed graph
whose thread loses its core cannot keep CUDA's launch queue filled (profiler/timed.py), and the nodes it
then queues are timed at its own pace. The host AdamW of the hardware profile shares the cores with them too.

So on CUDA, before anything is timed, `wait_until_children_quiet()` waits until the processes descended from this
one (read from /proc) use under QUIET_CORES of the CPU over QUIET_WINDOW_S, or QUIET_TIMEOUT_S have passed. Other
processes are left alone: they are not ours to wait for, and training shares the machine with them too.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

QUIET_CORES = 0.5  # the processes started by this one count as quiet under this many cores busy
QUIET_WINDOW_S = 0.1
QUIET_TIMEOUT_S = 30.0  # (a worker pool starts in seconds; a load that lasts longer, training will see too)
_PROC = Path("/proc")


def descendants_cpu_s(proc: Path = _PROC) -> float | None:
    """CPU seconds (user and system) the live processes descended from this one have used, with those of their
    children that have ended; None without /proc."""
    if not (proc / "self" / "stat").is_file():
        return None
    parents, ticks = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # (it ended meanwhile)
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command's name, which may hold anything
        pid = int(entry.name)
        # ppid; utime, stime, and cutime and cstime: those of its children that have ended and been waited for
        parents[pid], ticks[pid] = int(fields[1]), sum(int(f) for f in fields[11:15])
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, pending = 0, list(children.get(os.getpid(), ()))
    while pending:
        pid = pending.pop()
        total += ticks[pid]
        pending.extend(children.get(pid, ()))
    return total / os.sysconf("SC_CLK_TCK")


def wait_until_children_quiet(timeout_s: float = QUIET_TIMEOUT_S) -> float:
    """Wait until the processes descended from this one use under QUIET_CORES of the CPU (over QUIET_WINDOW_S),
    or `timeout_s` has passed; returns the seconds waited (0.0 where /proc is not there to tell)."""
    start = time.perf_counter()
    before = descendants_cpu_s()
    if before is None:
        return 0.0
    while True:
        time.sleep(QUIET_WINDOW_S)
        now = descendants_cpu_s()
        busy = max(0.0, now - before) / QUIET_WINDOW_S  # (a process that ended takes its seconds with it)
        waited = time.perf_counter() - start
        if busy < QUIET_CORES or waited >= timeout_s:
            break
        before = now
    if waited > 2 * QUIET_WINDOW_S:
        log.info(
            "waited %.1f s before timing, for the processes this one started (inductor's compile workers) to go "
            "quiet%s",
            waited,
            "" if busy < QUIET_CORES else f"; after {timeout_s:.0f} s they still use {busy:.1f} cores",
        )
    return waited
