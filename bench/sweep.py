"""`python -m bench sweep` (throughput across batch sizes) and `python -m bench maxsize` (the largest model that
trains), per system, each run in its own worker process as `compare` does.

    python -m bench sweep --systems protrain,fsdp2-offload-ac --batches 4,8,16,32
    python -m bench maxsize --systems protrain-chunks,fsdp2-offload --family llama
    python -m bench scaling --systems protrain-chunks --preset 5.5b --gpus 1,2,4

sweep: tokens/s of every system at every batch size; a system's "maximum throughput" (the paper's) is its best
over the batches. maxsize: bisection over a ladder of growing models of one family (`LADDER`: hidden size and
blocks as in the paper's Table "Model configuration", 1.9B to 78B for LLaMA sizes); a size counts as trainable
when `--steps` steps (3 by default here) finish with a finite loss. Bisection assumes that a system that trains
a size trains every smaller one. scaling: tokens/s of data-parallel systems on N ranks (torchrun, every rank the
same batch size) and the efficiency tokens/s(N) / (N tokens/s(1)); it exits 1 where a run failed, as compare does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from pathlib import Path

from bench.model import PRESETS, ModelSpec, preset, spec_parameters
from bench.table import table

log = logging.getLogger(__name__)

# (hidden, intermediate, heads, blocks): LLaMA-style proportions, growing parameter counts (another family's: `_spec`)
LADDER = [
    *((4096, 11008, 32, blocks) for blocks in (8, 16, 26, 32, 40, 48, 64, 80, 96, 128)),
    *((8192, 22016, 64, blocks) for blocks in (40, 48, 64, 80, 96)),
]


def sweep(args: argparse.Namespace) -> int:
    from bench.cli import _git_commit, _run_worker, parse_systems, runnable

    systems, batches = runnable(parse_systems(args.systems)), [int(b) for b in args.batches.split(",")]
    results = {
        s: {b: _run_worker(s, argparse.Namespace(**{**vars(args), "batch": b})) for b in batches} for s in systems
    }
    header = ("system", *(f"batch {b} tokens/s" for b in batches), "best tokens/s", "best batch")
    rows = [header]
    for system, by_batch in results.items():
        speeds = {b: r.get("tokens_per_s") for b, r in by_batch.items()}
        ok = {b: v for b, v in speeds.items() if v is not None and math.isfinite(by_batch[b]["loss_last"])}
        best = max(ok, key=ok.get, default=None)
        cells = [f"{v:.1f}" if b in ok else "failed" for b, v in speeds.items()]
        rows.append((system, *cells, f"{ok[best]:.1f}" if best else "-", str(best or "-")))
    print(table(rows))
    _write(
        args, {"commit": _git_commit(), "results": {s: {str(b): r for b, r in v.items()} for s, v in results.items()}}
    )
    return 0


def scaling(args: argparse.Namespace) -> int:
    from bench.cli import _git_commit, _run_worker, parse_systems, runnable

    systems, counts = runnable(parse_systems(args.systems)), [int(n) for n in args.gpus.split(",")]
    not_parallel = [s for s in systems if s in ("protrain", "compile", "compile-amp", "eager")]
    if not_parallel:
        raise SystemExit(f"{not_parallel} train each rank alone (no gradient reduction): scaling measures none of them")
    results = {s: {n: _run_worker(s, args, nproc=n) for n in counts} for s in systems}
    rows = [("system", *(f"{n} ranks tokens/s (eff.)" for n in counts))]
    for system, by_count in results.items():
        one = by_count.get(1, {}).get("tokens_per_s")
        cells = []
        for n, r in by_count.items():
            speed = r.get("tokens_per_s")
            eff = f" ({speed / (n * one):.0%})" if speed and one else ""
            cells.append(f"{speed:.1f}{eff}" if speed else "failed")
        rows.append((system, *cells))
    print(table(rows))
    _write(
        args, {"commit": _git_commit(), "results": {s: {str(n): r for n, r in v.items()} for s, v in results.items()}}
    )
    return _failed_runs(results)


def _failed_runs(results: dict[str, dict[int, dict]]) -> int:
    """1 where a worker gave an error instead of a result (logged), as `compare` exits: an efficiency needs every
    rank count's run, and the exit code is what a caller checks before reading the report."""
    failed = [(s, n, r["error"]) for s, by_count in results.items() for n, r in by_count.items() if "error" in r]
    for system, n, error in failed:
        log.error("%s on %d ranks failed: %s", system, n, error)
    return 1 if failed else 0


def maxsize(args: argparse.Namespace) -> int:
    from bench.cli import _git_commit, parse_systems, runnable

    ladder = [_spec(args, *sizes) for sizes in ladder_of(args.ladder)]
    report, rows = {"commit": _git_commit(), "systems": {}}, [("system", "largest trained", "params B", "tried")]
    for system in runnable(parse_systems(args.systems)):
        results: dict[int, dict] = {}  # id(spec) -> its worker's result
        largest, tried = bisect_largest(
            ladder, lambda spec, system=system, results=results: _trains(system, spec, args, results)
        )
        report["systems"][system] = {
            "largest": dataclasses.asdict(largest) if largest else None,
            "params": _params(largest) if largest else None,
            "tried": [
                {
                    "spec": dataclasses.asdict(spec),
                    "params": _params(spec),
                    "trains": ok,
                    **{k: results[id(spec)].get(k) for k in ("error", "peak_gpu_bytes", "peak_rss_bytes", "plan")},
                }
                for spec, ok in tried
            ],
        }
        size = f"{_params(largest) / 1e9:.1f}" if largest else "-"
        rows.append((system, _describe(largest), size, ", ".join(f"{_describe(s)}: {ok}" for s, ok in tried)))
    print(table(rows))
    _write(args, report)
    return 0


def ladder_of(entries: str) -> list[tuple[int, int, int, int]]:
    """The `LADDER` entries named by `--ladder` ("HIDDENxBLOCKS,..."), in ladder order; all of it if empty."""
    if not entries:
        return list(LADDER)
    by_name = {f"{h}x{blocks}": (h, i, heads, blocks) for h, i, heads, blocks in LADDER}
    unknown = [e for e in entries.split(",") if e not in by_name]
    if unknown:
        raise SystemExit(f"--ladder entries {unknown} are not in the ladder; pick from {', '.join(by_name)}")
    named = set(entries.split(","))
    return [sizes for name, sizes in by_name.items() if name in named]


def bisect_largest(ladder: list, trains) -> tuple[object | None, list[tuple[object, bool]]]:
    """The largest entry of `ladder` (sorted by size) for which `trains(entry)` holds, by bisection, with the
    entries tried and their outcome."""
    lo, hi, tried = 0, len(ladder) - 1, []  # the answer is in ladder[lo - 1 .. hi]
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        ok = trains(ladder[mid])
        tried.append((ladder[mid], ok))
        if ok:
            best, lo = ladder[mid], mid + 1
        else:
            hi = mid - 1
    return best, tried


def _trains(system: str, spec: ModelSpec, args: argparse.Namespace, results: dict[int, dict]) -> bool:
    """Whether `system` trains `spec`; its worker's result goes into `results[id(spec)]`, with the reason as
    "error" where it did not train (the report keeps both)."""
    from bench.cli import _run_worker

    run = argparse.Namespace(**{**vars(args), **dataclasses.asdict(spec), "warmup": 0})
    result = results[id(spec)] = dict(_run_worker(system, run))
    ok = "error" not in result and all(math.isfinite(x) for x in result.get("losses", [math.nan]))
    if not ok:
        result.setdefault("error", "non-finite loss")
    log.info("%s at %s: %s", system, _describe(spec), "trains" if ok else result["error"])
    return ok


def _spec(args: argparse.Namespace, hidden: int, intermediate: int, heads: int, blocks: int) -> ModelSpec:
    """A ladder entry (LLaMA's proportions) in the proportions of `args.family`'s 5.5b preset: its MLP width over
    LLaMA's and its share of key/value heads."""
    own, llama = preset("5.5b", args.family), PRESETS["5.5b"]
    return ModelSpec(
        hidden=hidden,
        layers=blocks,
        intermediate=intermediate * own.intermediate // llama.intermediate,
        heads=heads,
        kv_heads=heads * own.kv_heads // own.heads,
        vocab=args.vocab,
        seq=args.seq,
        family=args.family,
    )


def _params(spec: ModelSpec) -> int:
    return spec_parameters(spec)


def _describe(spec: ModelSpec | None) -> str:
    return "-" if spec is None else f"h{spec.hidden} x {spec.layers}"


def _write(args: argparse.Namespace, report: dict) -> None:
    if args.out:
        report["args"] = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        log.info("wrote %s", args.out)
