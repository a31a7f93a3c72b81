"""The README's first command runs examples/train_llama.py: a small run of it trains and prints its plan."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_main_example_runs():
    small = "--hidden 32 --layers 2 --heads 2 --vocab 64 --seq 16 --batch 2 --steps 3 --executor eager".split()
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_llama.py"), *small],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "model.layers (2 x LlamaDecoderLayer" in out.stdout and "plan in force:" in out.stdout
    assert "steps 2-3:" in out.stdout
