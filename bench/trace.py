"""Overlap of copies and host work with GPU kernels, from a `torch.profiler` chrome trace (Kineto's export).

Kineto puts CPU and GPU events on one clock, `ts` and `dur` in microseconds. Events of every GPU in the trace are
pooled: the analysis assumes a trace of one device.

    overlap_report(events)            # how much of the copies and of the host AdamW runs beside kernels
    phase_report(events, phases)      # per phase (CPU annotations, e.g. bench.step_split's): how long the GPU
                                      # idled, and the rate each copy direction reached alone and beside the
                                      # other direction or the host AdamW
    step_lead_in(events, "bench.forward")  # per step after the first: how long the GPU idled before its first
                                      # kernel (the CPU's lead-in, where each step ends synchronized)
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

Intervals = list[tuple[float, float]]  # sorted, disjoint (start, end) pairs

CPU_CATEGORIES = ("cpu_op", "user_annotation")
COPY_DIRECTIONS = (("h2d", "HtoD"), ("d2h", "DtoH"))  # (report key, Kineto memcpy name part)


def load_events(path: str | Path) -> list[dict]:
    """The `traceEvents` of a chrome trace `export_chrome_trace` wrote (gzipped if the name ends in .gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def overlap_report(trace_events: list[dict], cpu_name: str = "protrain::cpu_adamw") -> dict:
    """Kernel busy time, H2D and D2H copy time and the CPU events named like `cpu_name`, with their overlap.

    Times are in microseconds; each time is of the union of its events' intervals (the CPU events': per thread,
    summed), so nested or concurrent events count once. An `*_overlap` is the fraction of that time during which
    some kernel runs, None where the time is 0.
    """
    complete = [e for e in trace_events if e.get("ph") == "X" and "dur" in e]
    kernels = _union(_span(e) for e in complete if e.get("cat") == "kernel")
    report = {"kernel_us": _length(kernels)}
    for key, direction in COPY_DIRECTIONS:
        copies = _union(_span(e) for e in complete if e.get("cat") == "gpu_memcpy" and direction in e.get("name", ""))
        report[f"{key}_us"] = _length(copies)
        report[f"{key}_overlap"] = _fraction(_length(_intersect(copies, kernels)), report[f"{key}_us"])

    matching = [e for e in complete if e.get("cat") in CPU_CATEGORIES and cpu_name in e.get("name", "")]
    by_thread: dict[tuple, list[tuple[float, float]]] = {}
    for e in matching:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(_span(e))
    spans = [_union(thread_spans) for thread_spans in by_thread.values()]
    cpu_us = sum(_length(s) for s in spans)
    overlapped_us = sum(_length(_intersect(s, kernels)) for s in spans)
    report.update(
        cpu_name=cpu_name, cpu_events=len(matching), cpu_us=cpu_us, cpu_overlap=_fraction(overlapped_us, cpu_us)
    )
    return report


def phase_report(trace_events: list[dict], phases: list[str], cpu_name: str = "protrain::cpu_adamw") -> dict:
    """Per phase (the spans of the CPU annotations named in `phases`): its length, the time no kernel ran in it,
    and per copy direction the bytes copied, the time they took and their rate, also split by what ran beside
    each copy for most of its time: nothing else (`alone`), a copy the other way (`both`), the host work named
    `cpu_name` (`host`) or both of those (`both+host`). A copy counts in the phase it starts in. Times in
    microseconds, rates in bytes per second (None where nothing was copied)."""
    complete = [e for e in trace_events if e.get("ph") == "X" and "dur" in e]
    kernels = _union(_span(e) for e in complete if e.get("cat") == "kernel")
    host = _union(_span(e) for e in complete if e.get("cat") in CPU_CATEGORIES and cpu_name in e.get("name", ""))
    copies = {
        key: [e for e in complete if e.get("cat") == "gpu_memcpy" and direction in e.get("name", "")]
        for key, direction in COPY_DIRECTIONS
    }
    busy = {key: _union(_span(e) for e in events) for key, events in copies.items()}
    report = {}
    for phase in phases:
        spans = _union(_span(e) for e in complete if e.get("cat") in CPU_CATEGORIES and e.get("name") == phase)
        row = {"span_us": _length(spans), "idle_us": _length(spans) - _length(_intersect(spans, kernels))}
        for key, other in (("h2d", "d2h"), ("d2h", "h2d")):
            mine = [e for e in copies[key] if any(a <= float(e["ts"]) < b for a, b in spans)]
            split: dict[str, list[float]] = {}
            for e in mine:
                span, dur = [_span(e)], float(e["dur"])
                beside_other = _length(_intersect(span, busy[other])) > dur / 2
                beside_host = _length(_intersect(span, host)) > dur / 2
                where = {(False, False): "alone", (True, False): "both", (False, True): "host"}.get(
                    (beside_other, beside_host), "both+host"
                )
                totals = split.setdefault(where, [0.0, 0.0])
                totals[0] += float(e.get("args", {}).get("bytes", 0))
                totals[1] += dur
            nbytes, us = sum(b for b, _ in split.values()), sum(t for _, t in split.values())
            row[key] = {
                "bytes": nbytes,
                "us": us,
                "bytes_per_s": nbytes / us * 1e6 if us else None,
                "by_company": {
                    w: {"bytes": b, "us": t, "bytes_per_s": b / t * 1e6 if t else None} for w, (b, t) in split.items()
                },
            }
        report[phase] = row
    return report


def step_lead_in(trace_events: list[dict], step_name: str) -> list[float]:
    """Microseconds the GPU idled before each step's first kernel: from the end of the last kernel before the
    step's CPU annotation `step_name` began (on the GPU, the previous step's end) to the first kernel that
    starts after it. Steps with no kernel before them (the first one traced) are left out."""
    complete = [e for e in trace_events if e.get("ph") == "X" and "dur" in e]
    kernels = _union(_span(e) for e in complete if e.get("cat") == "kernel")
    starts = sorted(_span(e)[0] for e in complete if e.get("cat") in CPU_CATEGORIES and e.get("name") == step_name)
    idle = []
    for start in starts:
        before = [end for _, end in kernels if end <= start]
        after = [begin for begin, _ in kernels if begin >= start]
        if before and after:
            idle.append(after[0] - before[-1])
    return idle


def format_phases(report: dict) -> str:
    """`phase_report`'s result as a table: ms, GPU idle ms, and GB/s per copy direction and company."""
    lines = ["phase | ms | GPU idle ms | copies: direction, company, GB copied, ms, GB/s"]
    for phase, row in report.items():
        parts = []
        for key in ("h2d", "d2h"):
            for where, c in sorted(row[key]["by_company"].items()):
                rate = "-" if c["bytes_per_s"] is None else f"{c['bytes_per_s'] / 1e9:.1f}"
                parts.append(f"{key} {where} {c['bytes'] / 1e9:.2f} GB {c['us'] / 1e3:.1f} ms {rate}")
        lines.append(f"{phase} | {row['span_us'] / 1e3:.1f} | {row['idle_us'] / 1e3:.1f} | {'; '.join(parts) or '-'}")
    return "\n".join(lines)


def format_report(report: dict) -> str:
    """The report as a small table: time in ms and the fraction of it overlapping GPU kernels."""
    rows = [
        ("GPU kernels (busy)", report["kernel_us"], None),
        ("H2D memcpy", report["h2d_us"], report["h2d_overlap"]),
        ("D2H memcpy", report["d2h_us"], report["d2h_overlap"]),
        (f"CPU '{report['cpu_name']}' ({report['cpu_events']} events)", report["cpu_us"], report["cpu_overlap"]),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'':{width}} | {'ms':>9} | overlaps kernels", f"{'-' * width}-+-{'-' * 9}-+-{'-' * 16}"]
    for name, us, fraction in rows:
        lines.append(f"{name:{width}} | {us / 1e3:9.2f} | {'-' if fraction is None else f'{fraction:.1%}'}")
    return "\n".join(lines)


def _span(event: dict) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event["dur"])


def _union(intervals) -> Intervals:
    merged: Intervals = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    """The intersection of two unions (sorted, disjoint), by a sweep over both."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def _fraction(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None
