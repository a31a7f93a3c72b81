"""`python -m bench plot`: throughput against model size per system, from `compare` reports, as a PNG.

    python -m bench plot out/compare-1b.json out/compare-5.5b.json --out docs/throughput.png

Each report holds one model size; a system's points are joined across the reports in order of size. Needs
matplotlib (`pip install matplotlib`, or the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("bench plot needs matplotlib: pip install matplotlib") from e
    points: dict[str, list[tuple[float, float]]] = {}
    devices = set()
    for path in args.reports:
        report = json.loads(Path(path).read_text())
        devices.add(report.get("device") or "?")
        for r in report["results"]:
            if "tokens_per_s" in r:  # (not a failed or skipped system)
                points.setdefault(r["system"], []).append((r["params"] / 1e9, r["tokens_per_s"]))
    if not points:
        raise SystemExit(f"no successful run in {args.reports}")
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, xy in sorted(points.items()):
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=system)
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("tokens/s")
    ax.set_yscale("log")
    ax.set_title(", ".join(sorted(devices)))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    log.info("wrote %s", args.out)
    return 0
