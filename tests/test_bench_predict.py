"""bench predict's table (bench/predict.py): a row per plan, and a diverged run shows as one; the summary against
issue 5's targets."""

import math

from bench.predict import format_table, summary


def _row(loss_last: float, measured_s: float = 0.11, peak_error: float = 0.0, forced=None) -> dict:
    pvm = dict(
        predicted_step_s=0.1,
        measured_step_s=measured_s,
        step_error=0.1 / measured_s - 1,
        predicted_peak_bytes=2**30,
        measured_peak_bytes=2**30,
        peak_error=peak_error,
    )
    plan = dict(n_persist=2, n_buffer=3, n_swap=0, n_checkpoint=4)
    graph = dict(plan=plan, predicted_vs_measured=pvm, seconds=dict(profile=1.0, search=0.1))
    forced = {"n_checkpoint": 4} if forced is None else forced
    steps = [10.0, 0.5] + [measured_s] * 6  # the first step compiles, profiles and searches
    result = dict(step_time_s=measured_s, loss_last=loss_last, step_times_s=steps)
    return dict(forced=forced, result=result, graphs=[graph])


def test_table_shows_the_last_loss_and_a_nan():
    table = format_table([_row(10.5), _row(math.nan)])
    lines = table.splitlines()
    assert "last loss" in lines[0]
    assert lines[-2].rstrip().endswith("10.5000") and lines[-1].rstrip().endswith("nan")
    assert "2/3/0/4" in lines[-1] and "-9.1%" in lines[-1]


def test_summary_counts_the_plans_within_the_targets():
    rows = [
        _row(10.5, measured_s=0.102, forced={}),  # searched: -2.0%, 2% slower than the fastest forced
        _row(10.5, measured_s=0.1),  # 0%
        _row(10.5, measured_s=0.12, peak_error=-0.03),  # -16.7%; peak under by 3%
        {"forced": {"n_persist": 1}, "result": {"error": "out of memory"}, "graphs": []},
    ]
    lines = summary(rows).splitlines()
    assert lines[0] == "step time within 5%: 2 of 3; peak within 5% and never under by 2%: 2 of 3"
    assert lines[1] == "searched plan against the fastest forced one: +2.0%"
    # 1.1 s of profiling and search against 10 + 0.5 + 98 steps (8 run, 92 more at the measured time)
    shares = [1.1 / (10.5 + 98 * s) for s in (0.102, 0.1, 0.12)]
    assert lines[2] == (
        f"profiling, hardware profile and search: at most {max(shares):.1%} of the first 100 steps (target under "
        f"10%); searched plans: {shares[0]:.1%}"
    )
    assert summary(rows[1:]).splitlines()[1:] == [  # (no searched plan)
        f"profiling, hardware profile and search: at most {max(shares):.1%} of the first 100 steps (target under "
        "10%); searched plans: -"
    ]
