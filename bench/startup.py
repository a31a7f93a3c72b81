"""`python -m bench startup`: time to the first training step, cold and warm, per system.

    python -m bench startup --systems compile,protrain-chunks --preset 5.5b
    python -m bench startup --hidden 256 --layers 4 --intermediate 688 --heads 4 --vocab 2048 --seq 128 --batch 4 \
        --dtype float32                                  # the CPU model of the relaunch figures

Each system runs its worker twice in one fresh cache directory: inductor's (TORCHINDUCTOR_CACHE_DIR) and
protrain's ($PROTRAIN_CACHE_DIR: the plan cache). "cold" is the first process, with empty caches, "warm" a
relaunch over what the first left. The hardware profile measured on this machine before is copied into the fresh
directory (`--measure-hardware` measures it again, as a machine's very first run does). The figure is the first
step's wall time: torch.compile is lazy, so it holds the compile, and protrain's capture, profile and search; each
of protrain's phases (the progress lines of backend/phases.py) is reported on its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench.table import table

log = logging.getLogger(__name__)

RUNS = ("cold", "warm")


def startup(args: argparse.Namespace) -> int:
    from bench.cli import _git_commit, parse_systems, run_for_result, runnable, worker_flags

    run = argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0})
    results: dict[str, dict[str, dict]] = {}
    for system in runnable(parse_systems(args.systems)):
        with tempfile.TemporaryDirectory(prefix="protrain-startup-") as root:
            env = _cache_env(Path(root), copy_hardware=not args.measure_hardware)
            cmd = [sys.executable, "-m", "bench", "worker", "--system", system, *worker_flags(run)]
            results[system] = {name: run_for_result(cmd, system, env=env) for name in RUNS}
    print(table(_rows(results)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"commit": _git_commit(), "results": results}, indent=1))
    failed = [f"{s} {n}" for s, by_run in results.items() for n, r in by_run.items() if "error" in r]
    if failed:
        log.error("no result from: %s", ", ".join(failed))
    return 1 if failed else 0


def _cache_env(root: Path, copy_hardware: bool) -> dict[str, str]:
    """This process's environment with both caches in `root`, and the known hardware profile copied there."""
    from protrain_fx.cache_dir import default_cache_dir

    protrain = root / "protrain"
    protrain.mkdir()
    known = default_cache_dir() / "hardware"
    if copy_hardware and known.is_dir():
        shutil.copytree(known, protrain / "hardware")
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "PROTRAIN_CACHE_DIR": str(protrain)}


def _rows(results: dict[str, dict[str, dict]]) -> list[tuple[str, ...]]:
    """One row per system: the first step cold and warm, warm over the first system's warm, the phases."""
    rows = [("system", "first step cold s", "warm s", "warm / first system's warm", "phases cold", "phases warm")]
    base = None
    for system, by_run in results.items():
        first = {n: r["step_times_s"][0] if "step_times_s" in r else None for n, r in by_run.items()}
        base = first["warm"] if base is None else base
        ratio = f"{first['warm'] / base:.2f}" if first["warm"] and base else "-"
        cells = [f"{first[n]:.2f}" if first[n] is not None else by_run[n].get("error", "-") for n in RUNS]
        phases = [_phases(by_run[n].get("phases_s")) for n in RUNS]
        rows.append((system, *cells, ratio, *phases))
    return rows


def _phases(phases: dict | None) -> str:
    """`capture 0.41, profile 3.20, ...` summed over graphs; a phase taken from the plan cache reads `cache`."""
    if not phases:
        return "-"
    return ", ".join(f"{name} {s:.2f}" if isinstance(s, float) else f"{name} {s}" for name, s in phases.items())
