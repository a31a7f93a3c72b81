"""bench predict's table (bench/predict.py): a row per plan, and a diverged run shows as one."""

import math

from bench.predict import format_table


def _row(loss_last: float) -> dict:
    pvm = dict(
        predicted_step_s=0.1,
        measured_step_s=0.11,
        step_error=-0.09,
        predicted_peak_bytes=2**30,
        measured_peak_bytes=2**30,
        peak_error=0.0,
    )
    plan = dict(n_persist=2, n_buffer=3, n_swap=0, n_checkpoint=4)
    graph = dict(plan=plan, predicted_vs_measured=pvm, seconds=dict(profile=1.0, search=0.1))
    return dict(forced={"n_checkpoint": 4}, result=dict(step_time_s=0.11, loss_last=loss_last), graphs=[graph])


def test_table_shows_the_last_loss_and_a_nan():
    table = format_table([_row(10.5), _row(math.nan)])
    lines = table.splitlines()
    assert "last loss" in lines[0]
    assert lines[-2].rstrip().endswith("10.5000") and lines[-1].rstrip().endswith("nan")
    assert "2/3/0/4" in lines[-1] and "-9.0%" in lines[-1]
