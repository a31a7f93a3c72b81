"""Timing waits for the processes this one started to go quiet (protrain_fx/profiler/quiet.py)."""

import subprocess
import sys
import time

import pytest

from protrain_fx.profiler import quiet

pytestmark = pytest.mark.skipif(quiet.descendants_cpu_s() is None, reason="needs /proc")

# two spinning processes for `seconds`, started by a child as inductor's sidecar starts its workers
SPIN = "import time\nend = time.perf_counter() + {seconds}\nwhile time.perf_counter() < end: pass\n"
PARENT = (
    "import subprocess, sys\n"
    "spinners = [subprocess.Popen([sys.executable, '-c', {spin!r}]) for _ in range(2)]\n"
    "[p.wait() for p in spinners]\n"
)


def test_grandchildren_cpu_seconds_count():
    """Read from /proc: no timing threshold, so a loaded machine that gives the spinners little CPU still passes."""
    child = subprocess.Popen([sys.executable, "-c", PARENT.format(spin=SPIN.format(seconds=1.5))])
    try:
        time.sleep(0.3)  # (all started: the grandchildren spinning)
        used = quiet.descendants_cpu_s()
        time.sleep(0.5)
        assert quiet.descendants_cpu_s() > used
    finally:
        child.wait()


def _busy_for(seconds: float, cores: float = 2.0):
    """A stand-in for descendants_cpu_s: `cores` busy from the first call until `seconds` later, then quiet."""
    start = []

    def cpu_s() -> float:
        now = time.perf_counter()
        start.append(now)
        return cores * min(now - start[0], seconds)

    return cpu_s


def test_waits_while_busy_and_not_after(monkeypatch):
    monkeypatch.setattr(quiet, "descendants_cpu_s", _busy_for(1.0))
    assert 1.0 <= quiet.wait_until_children_quiet() < 5.0
    monkeypatch.setattr(quiet, "descendants_cpu_s", _busy_for(0.0))
    assert quiet.wait_until_children_quiet() < 5 * quiet.QUIET_WINDOW_S


def test_gives_up_after_the_timeout(monkeypatch):
    monkeypatch.setattr(quiet, "descendants_cpu_s", _busy_for(float("inf")))
    assert 0.5 <= quiet.wait_until_children_quiet(timeout_s=0.5) < 3.0
