"""HostUpdates: the offloaded chunks' host work on the worker thread (host_queue.py), one task per chunk at a time:
its CPU AdamW update, and adding a second gradient of one step into its shard, each queued behind the copy it reads.

Whoever reads a chunk's host shard waits for its task (`wait`); the next forward's gather of the chunk waits only for
that chunk's (`pending`). The worker notes how long each update took (`timings`: parameters, seconds), which the step
monitor sets beside the hardware profile's rate (runtime/monitor.py).

State it owns: the worker thread, each chunk's task not yet waited for, the timings of the latest updates.
"""

from __future__ import annotations

import collections
import concurrent.futures
import weakref
from collections.abc import Callable

from protrain_fx.host_queue import HostQueue
from protrain_fx.runtime.chunks.common import HOST_UPDATES_KEPT


class HostUpdates:
    """The worker thread's tasks for the offloaded chunks (module docstring)."""

    def __init__(self, *, spare_core: bool):
        """`spare_core`: training on a GPU (HostQueue): the worker leaves one core to the thread launching its work."""
        self._queue = HostQueue(spare_core=spare_core)
        weakref.finalize(self, self._queue.close)
        self._tasks: dict[int, concurrent.futures.Future] = {}  # chunk -> its task, until waited for
        # (parameters, seconds) of the latest updates (not those that also copy aside what they change)
        self.timings: collections.deque[tuple[int, float]] = collections.deque(maxlen=HOST_UPDATES_KEPT)

    def submit(self, chunk: int, copied, task: Callable[[], None]) -> None:
        """Run `task` on the worker thread once `copied` (a CUDA event, or None) has completed."""
        self._tasks[chunk] = self._queue.submit(chunk, copied, task)

    def pending(self, chunk: int) -> bool:
        """Whether the chunk's task is queued and not done."""
        task = self._tasks.get(chunk)
        return task is not None and not task.done()

    def queued(self) -> list[int]:
        """The chunks whose task was not waited for yet (done or not), in the order they were queued."""
        return list(self._tasks)

    def wait(self, chunk: int | None = None) -> None:
        """Block until the chunk's task (every chunk's, if None) is done; its error, if it raised, raises here."""
        for c in [chunk] if chunk is not None else list(self._tasks):
            task = self._tasks.pop(c, None)
            if task is not None:
                task.result()

    def timed(self, params: int, seconds: float) -> None:
        """The worker thread: an update of `params` parameters took `seconds`."""
        self.timings.append((params, seconds))
