"""Timing waits for the processes this one started to go quiet (protrain_fx/profiler/quiet.py)."""

import subprocess
import sys
import time

import pytest

from protrain_fx.profiler import quiet

pytestmark = pytest.mark.skipif(quiet.descendants_cpu_s() is None, reason="needs /proc")

# two spinning processes for `seconds`, so that they use over QUIET_CORES also on a 2-core machine that runs other
# tests; started by a child as inductor's sidecar starts its workers, or directly
SPIN = "import time\nend = time.perf_counter() + {seconds}\nwhile time.perf_counter() < end: pass\n"
PARENT = (
    "import subprocess, sys\n"
    "spinners = [subprocess.Popen([sys.executable, '-c', {spin!r}]) for _ in range(2)]\n"
    "[p.wait() for p in spinners]\n"
)


def test_waits_while_grandchildren_spin_and_not_after():
    child = subprocess.Popen([sys.executable, "-c", PARENT.format(spin=SPIN.format(seconds=1.5))])
    try:
        time.sleep(0.3)  # (all started: the grandchildren spinning)
        used = quiet.descendants_cpu_s()
        waited = quiet.wait_until_children_quiet()
        assert quiet.descendants_cpu_s() > used  # the grandchildren's seconds count
        assert 0.6 <= waited <= 5.0
    finally:
        child.wait()
    assert quiet.wait_until_children_quiet() < 2 * quiet.QUIET_WINDOW_S + 0.1


def test_gives_up_after_the_timeout():
    children = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=3)]) for _ in range(2)]
    try:
        time.sleep(0.2)
        assert 0.5 <= quiet.wait_until_children_quiet(timeout_s=0.5) < 1.5
    finally:
        for child in children:
            child.kill()
            child.wait()
