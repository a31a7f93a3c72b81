"""The host worker runs, among the tasks whose copy has landed, the lowest chunk first."""

import threading

import pytest

from protrain_fx.runtime.host_queue import HostQueue


def test_lowest_landed_chunk_first_and_errors_reach_the_waiter():
    queue = HostQueue()
    started, gate, ran = threading.Event(), threading.Event(), []
    first = queue.submit(9, None, lambda: (started.set(), gate.wait(), ran.append(9)))
    started.wait(timeout=10)  # the worker is busy with 9 while the others queue up
    later = [queue.submit(c, None, lambda c=c: ran.append(c)) for c in (7, 3, 5)]
    gate.set()
    for f in [first, *later]:
        f.result(timeout=10)
    assert ran == [9, 3, 5, 7]

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        queue.submit(1, None, fail).result(timeout=10)
    queue.close()
