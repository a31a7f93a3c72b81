"""bench.trace.overlap_report on synthetic chrome-trace events (times in microseconds)."""

import json

import pytest

from bench.trace import format_phases, format_report, load_events, overlap_report, phase_report, step_lead_in


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


def _copy(direction, ts, dur, nbytes):
    event = _event("gpu_memcpy", f"Memcpy {direction} (Pinned -> Device)", ts, dur, tid=9)
    return {**event, "args": {"bytes": nbytes}}


def test_phase_report():
    events = [
        _event("user_annotation", "fwd", 0, 100),
        _event("user_annotation", "bwd", 100, 100),
        _event("kernel", "gemm", 0, 60, tid=7),  # forward: 40 idle
        _event("kernel", "gemm", 100, 100, tid=7),  # backward: none idle
        _copy("DtoH", 10, 20, 2_000),  # alone: 100 bytes/us
        _copy("DtoH", 40, 20, 1_000),  # beside the H2D copy below for 15 of 20 us: "both"
        _copy("HtoD", 45, 30, 3_000),  # beside the D2H copy for 15 of 30 us only: alone
        _copy("DtoH", 150, 10, 500),  # beside the host AdamW: "host"
        _copy("HtoD", 195, 40, 4_000),  # starts in the backward, ends after it: the backward's
        _event("user_annotation", "protrain::cpu_adamw", 140, 50, tid=2),
    ]
    report = phase_report(events, ["fwd", "bwd", "absent"])
    fwd, bwd = report["fwd"], report["bwd"]
    assert (fwd["span_us"], fwd["idle_us"], bwd["idle_us"]) == (100, 40, 0)
    assert fwd["d2h"]["bytes"] == 3_000 and fwd["d2h"]["us"] == 40
    assert fwd["d2h"]["by_company"]["alone"]["bytes_per_s"] == pytest.approx(100e6)
    assert fwd["d2h"]["by_company"]["both"]["bytes_per_s"] == pytest.approx(50e6)
    assert set(fwd["h2d"]["by_company"]) == {"alone"}
    assert bwd["d2h"]["by_company"] == {"host": {"bytes": 500, "us": 10, "bytes_per_s": pytest.approx(50e6)}}
    assert bwd["h2d"]["bytes"] == 4_000
    assert report["absent"]["span_us"] == 0 and report["absent"]["h2d"]["bytes_per_s"] is None
    table = format_phases(report)
    assert table.splitlines()[1].startswith("fwd | 0.1 | 0.0 | h2d alone") and "d2h host" in table


def test_step_lead_in():
    """Steps begin (CPU annotation) at 0, 1000 and 2000; the GPU's last kernel before the second ends at 900 and
    its first after begins at 1300 (400 idle); before the third, kernels on two streams end at 1900 and 1950, and
    the next begins at 2010 (60 idle). The first step has no kernel before it."""
    events = [
        _event("user_annotation", "bench.forward", 0, 100),
        _event("user_annotation", "bench.forward", 1000, 100),
        _event("user_annotation", "bench.forward", 2000, 100),
        _event("user_annotation", "bench.backward", 1100, 100),  # (another phase: not a step's start)
        _event("kernel", "gemm", 50, 850, tid=7),
        _event("kernel", "gemm", 1300, 600, tid=7),
        _event("kernel", "adamw", 1800, 150, tid=8),
        _event("kernel", "gemm", 2010, 100, tid=7),
    ]
    assert step_lead_in(events, "bench.forward") == [400, 60]
    assert step_lead_in(events, "nothing") == []
