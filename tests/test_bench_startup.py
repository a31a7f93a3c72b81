"""bench startup (bench/startup.py): each system's two runs share one fresh cache directory of their own, with the
known hardware profile copied in; the workers report protrain's compile phases from its progress lines."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import bench.cli
from bench import startup as startup_module
from bench.worker import _phase_times
from protrain_fx.backend import phases


def test_both_runs_of_a_system_share_a_fresh_cache_with_the_hardware_profile(monkeypatch, tmp_path, capsys):
    known = tmp_path / "known"
    (known / "hardware").mkdir(parents=True)
    (known / "hardware" / "machine.json").write_text("{}")
    monkeypatch.setattr("protrain_fx.cache_dir.default_cache_dir", lambda: known)
    seen = []

    def worker(cmd, system, env=None):
        cache = Path(env["PROTRAIN_CACHE_DIR"])
        seen.append((system, cache, env["TORCHINDUCTOR_CACHE_DIR"], (cache / "hardware" / "machine.json").is_file()))
        first = len([s for s in seen if s[0] == system]) == 1
        phases_s = {"captured": 1.0, "profiled": 2.0} if first else {"captured": 1.0, "profiled": "cache"}
        return {"system": system, "step_times_s": [10.0 if first else 4.0], "phases_s": phases_s}

    monkeypatch.setattr(bench.cli, "run_for_result", worker)  # (no worker process is started)
    monkeypatch.setattr(bench.cli, "_git_commit", lambda: "commit")
    out = tmp_path / "startup.json"
    args = argparse.Namespace(**_args(), systems="compile,protrain-chunks", measure_hardware=False, out=str(out))
    assert startup_module.startup(args) == 0

    (a1, a2), (b1, b2) = seen[:2], seen[2:]
    assert a1[1:3] == a2[1:3] and b1[1:3] == b2[1:3] and a1[1] != b1[1]  # (one directory per system, both runs)
    assert all(s[3] for s in seen) and all(s[2].startswith(str(s[1].parent)) for s in seen)
    assert not a1[1].exists()  # (removed after the system's runs)
    printed = capsys.readouterr().out
    assert "protrain-chunks | 10.00" in printed and "captured 1.00, profiled cache" in printed
    assert set(json.loads(out.read_text())["results"]) == {"compile", "protrain-chunks"}


def test_the_worker_collects_each_phase_summed_over_graphs(monkeypatch):
    class Entry:
        def describe(self):
            return "entry"

    monkeypatch.setattr(phases, "_is_terminal", lambda: True)  # (no fallback handler: the collector alone)
    collected: dict = {}
    with _phase_times(collected):
        phases.phase_done(0, "capture", 1.5)
        phases.phase_done(1, "capture", 0.5)
        phases.phase_done(0, "profile", None, Entry())
        phases.phase_done(0, "forward", 3.0)
    assert collected == {"captured": 2.0, "profiled": "cache", "forward compiled": 3.0}
    assert logging.getLogger(phases.PROGRESS_LOGGER).level == logging.NOTSET  # (restored)


def _args() -> dict:
    """The size and run flags `bench startup` gets from the command line, for a tiny model."""
    parser = bench.cli._parser()
    args = parser.parse_args(["startup", "--hidden", "32", "--layers", "1", "--intermediate", "64", "--heads", "2"])
    for name, size in vars(args).items():
        if size is None:
            setattr(args, name, 8)
    return {k: v for k, v in vars(args).items() if k not in ("systems", "measure_hardware", "out", "func")}
