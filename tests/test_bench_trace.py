"""bench.trace.overlap_report on synthetic chrome-trace events (times in microseconds)."""

import json

import pytest

from bench.trace import format_report, load_events, overlap_report


def _event(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


EVENTS = [
    # kernels on two streams: busy 0-100 and 150-200 (the second stream's kernel lies inside the first's)
    _event("kernel", "gemm", 0, 100, tid=7),
    _event("kernel", "elementwise", 20, 30, tid=8),
    _event("kernel", "gemm", 150, 50, tid=7),
    # H2D: 80-120 (20 of it under kernels) and 300-320 (none): 60 in all, 20 overlapped
    _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 80, 40, tid=9),
    _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 300, 20, tid=9),
    # D2H entirely under a kernel
    _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 160, 10, tid=10),
    # device-to-device copies and annotations on the GPU timeline are none of the above
    _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 120, 200, tid=9),
    _event("gpu_user_annotation", "protrain::cpu_adamw", 0, 400, tid=7),
    # host AdamW on a worker thread, 90-190 (overlaps 10 + 40), with a nested op of the same name counted once
    _event("user_annotation", "protrain::cpu_adamw", 90, 100, tid=2),
    _event("cpu_op", "protrain::cpu_adamw_inner", 100, 20, tid=2),
    # on another thread, 400-410: no kernel
    _event("user_annotation", "protrain::cpu_adamw", 400, 10, tid=3),
    _event("cpu_op", "aten::mm", 0, 500, tid=1),
    {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}},
    {"ph": "i", "name": "marker", "ts": 5, "pid": 0, "tid": 1},
]


def test_overlap_report():
    report = overlap_report(EVENTS)
    assert report["kernel_us"] == pytest.approx(150)
    assert report["h2d_us"] == pytest.approx(60)
    assert report["h2d_overlap"] == pytest.approx(20 / 60)
    assert report["d2h_us"] == pytest.approx(10)
    assert report["d2h_overlap"] == pytest.approx(1.0)
    assert report["cpu_events"] == 3
    assert report["cpu_us"] == pytest.approx(110)
    assert report["cpu_overlap"] == pytest.approx(50 / 110)


def test_nothing_matching():
    report = overlap_report([_event("kernel", "gemm", 0, 10)], cpu_name="no such op")
    assert report["kernel_us"] == pytest.approx(10)
    assert report["h2d_us"] == report["d2h_us"] == report["cpu_us"] == 0
    assert report["h2d_overlap"] is report["d2h_overlap"] is report["cpu_overlap"] is None
    assert "-" in format_report(report)


def test_load_events_and_format(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": EVENTS}))
    table = format_report(overlap_report(load_events(path)))
    assert "33.3%" in table and "100.0%" in table and "45.5%" in table
