"""The HostUpdates part on its own (protrain_fx/runtime/chunks/host_updates.py): the offloaded chunks' tasks on the
worker thread, each waited for by chunk or all at once, an error raised where it is waited for, the timings kept."""

from __future__ import annotations

import threading

import pytest

from protrain_fx.runtime.chunks.common import HOST_UPDATES_KEPT
from protrain_fx.runtime.chunks.host_updates import HostUpdates


def test_a_chunk_waits_for_its_own_task_only():
    updates = HostUpdates(spare_core=False)
    release, ran = threading.Event(), []
    updates.submit(1, None, lambda: ran.append(1))
    updates.submit(3, None, lambda: release.wait(60) and ran.append(3))
    assert updates.queued() == [1, 3] and updates.pending(3)
    updates.wait(1)  # (chunk 3's task, still running, is not waited for)
    assert ran == [1] and updates.queued() == [3] and updates.pending(3) and not updates.pending(1)
    release.set()
    updates.wait()
    assert ran == [1, 3] and updates.queued() == [] and not updates.pending(3)


def test_a_task_that_raised_raises_where_it_is_waited_for():
    updates = HostUpdates(spare_core=False)

    def failing():
        raise ValueError("host update failed")

    updates.submit(0, None, failing)
    with pytest.raises(ValueError, match="host update failed"):
        updates.wait(0)
    updates.wait()  # (waited for once: gone)


def test_the_latest_timings_are_kept():
    updates = HostUpdates(spare_core=False)
    for i in range(HOST_UPDATES_KEPT + 3):
        updates.timed(1000, float(i))
    assert len(updates.timings) == HOST_UPDATES_KEPT and updates.timings[0] == (1000, 3.0)
