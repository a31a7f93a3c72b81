"""The type checker over the planner and the passes, and the pass contract's Protocols against the run-time objects
they stand for (tests/protocol_conformance.py): `mypy` as configured in pyproject.toml ([tool.mypy]), in a
subprocess. Its cache (.mypy_cache, ignored by git) keeps a run after the first to seconds; a cold run reads torch's
stubs, about 15 s of one core."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_planner_and_passes_type_check():
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"mypy found type errors:\n{run.stdout}{run.stderr}"
