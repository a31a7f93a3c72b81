"""The worker thread that runs the host side of offloaded chunks (their CPU AdamW steps).

Gradients arrive in backward order (last chunk first) but the next forward needs the first chunk first. The
CPU is usually the slower side, so work piles up by the end of the backward; this queue then runs, among the
tasks whose device-to-host copy has landed, the one of the lowest chunk index first. So the next forward
can start on the first updated chunks while the CPU still updates later ones. A task whose copy has not
landed is taken only when none has, the oldest first (copies land in submission order).

Beside runtime/ rather than in it: the hardware profile (profiler/microbench.py) times the host AdamW on this
thread, as training runs it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import os
import threading
import weakref
from collections.abc import Callable

import torch


class HostQueue:
    def __init__(self, name: str = "protrain-cpu-adam", *, spare_core: bool = False):
        """`spare_core`: for training on a GPU, where the main thread computes nothing on the CPU: torch's CPU
        kernels run on this rank's share of the cores (`host_threads`) but one, left to the thread that
        launches GPU work; with every core in the worker's parallel regions, that thread preempts one of them
        and the whole region waits for it. Without it (the CPU as the device) torch's thread count stands."""
        self._spare_core = spare_core
        self._cv = threading.Condition()
        self._tasks: dict[int, tuple[int, object, Callable[[], None], concurrent.futures.Future]] = {}
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        atexit.register(_close, weakref.ref(self))

    def submit(self, chunk: int, copied, fn: Callable[[], None]) -> concurrent.futures.Future:
        """Run `fn` once `copied` (a CUDA event, or None) has completed. One task per chunk at a time."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            assert chunk not in self._tasks, f"chunk {chunk} already has a host task queued"
            self._tasks[chunk] = (next(self._seq), copied, fn, future)
            self._cv.notify()
        return future

    def close(self) -> None:
        """Run what is queued, then stop the thread (also at interpreter exit, so no update is cut short)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _next(self):
        with self._cv:
            while not self._tasks and not self._closed:
                self._cv.wait()
            if not self._tasks:
                return None
            landed = [c for c, (_, copied, _, _) in self._tasks.items() if copied is None or copied.query()]
            chunk = min(landed) if landed else min(self._tasks, key=lambda c: self._tasks[c][0])
            return self._tasks.pop(chunk)

    def _run(self) -> None:
        if self._spare_core:
            torch.set_num_threads(max(1, host_threads() - 1))
        while (task := self._next()) is not None:
            _, copied, fn, future = task
            del task
            error = _execute(copied, fn)
            # the task is let go before its waiter wakes: its closure holds the chunk manager, and through it the
            # GPU chunks, which must go with their model
            del copied, fn
            if error is None:
                future.set_result(None)
            else:  # handed to whoever waits for this chunk
                future.set_exception(error)
            del future, error


def host_threads() -> int:
    """The cores this rank may use on the host: those the process may run on, shared among this machine's ranks
    (torchrun's LOCAL_WORLD_SIZE). Not torch's thread count, which torchrun sets to 1 (OMP_NUM_THREADS) in every
    rank it starts: the host AdamW would then run on one core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // machine_ranks())


def machine_ranks() -> int:
    """The ranks on this machine, which share its host (torchrun's LOCAL_WORLD_SIZE; a process started otherwise
    is its machine's only rank)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _execute(copied, fn: Callable[[], None]) -> BaseException | None:
    try:
        if copied is not None:
            copied.synchronize()
        fn()
    except BaseException as e:
        return e
    return None


def _close(ref: weakref.ref) -> None:
    queue = ref()
    if queue is not None:
        queue.close()
