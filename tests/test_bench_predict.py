"""bench predict's table (bench/predict.py): a row per plan, and a diverged run shows as one; the summary against
issue 5's targets; `bench from-dump`."""

import argparse
import json
import math

import models
import pytest
import torch
from helpers import train

import protrain_fx
from bench.predict import format_table, from_dump, summary


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


def test_table_shows_what_the_closed_loop_did():
    """`--replan on`: a kept plan with its calibrated prediction; a switch with the new plan's prediction and step."""
    kept, switched, off = _row(10.5), _row(10.5), _row(10.5)
    plan = dict(n_persist=4, n_buffer=0, n_swap=0, n_checkpoint=2, n_selective=0)
    kept["graphs"][0]["replan"] = {"switched": False, "before": {"predicted_step_s": 0.1094}, "plan": plan}
    switched["graphs"][0]["replan"] = {"switched": True, "before": {"predicted_step_s": 0.11}, "plan": plan}
    switched["graphs"][0]["replanned_vs_measured"] = {"predicted_step_s": 0.0951, "measured_step_s": 0.0962}
    lines = format_table([kept, switched, off]).splitlines()
    column = [c.strip() for c in lines[0].split("|")].index("after the loop")
    cells = [[c.strip() for c in line.split("|")][column] for line in lines[-3:]]
    assert cells == ["kept, 109.4 ms", "switched to 4/0/0/2/0: 95.1 / 96.2 ms", "-"]


def test_summary_counts_the_plans_within_the_targets():
    rows = [
        _row(10.5, measured_s=0.102, forced={}),  # searched: -2.0%, 2% slower than the fastest forced
        _row(10.5, measured_s=0.1),  # 0%
        _row(10.5, measured_s=0.12, peak_error=-0.03, forced={"n_persist": 2}),  # -16.7%; peak under by 3%
        {"forced": {"n_persist": 1}, "result": {"error": "out of memory"}, "graphs": []},
    ]
    rows[0]["graphs"][0]["seconds"]["hardware"] = 2.0  # the searched run measured the hardware profile
    lines = summary(rows).splitlines()
    assert lines[0] == "step time within 5%: 2 of 3; peak within 5% and never under by 2%: 2 of 3"
    assert (
        lines[1]
        == "searched plan against the fastest forced one: +2.0% by the step monitor, +2.0% by the harness's steps"
    )
    # 1.1 s of profiling and search (and 2 s of hardware profile in the first) against 10 + 0.5 + 98 steps
    # (8 run, 92 more at the measured time); with the hardware profile cached, its 2 s are left out of both
    shares = [(1.1 + hw) / (10.5 + 98 * s) for s, hw in ((0.102, 2.0), (0.1, 0), (0.12, 0))]
    cached = [1.1 / (10.5 - hw + 98 * s) for s, hw in ((0.102, 2.0), (0.1, 0), (0.12, 0))]
    assert max(shares) == shares[0] and max(cached) == cached[0] and cached[0] < shares[0]
    assert lines[2] == (
        f"profiling, hardware profile and search: at most {shares[0]:.1%} of the first 100 steps (target under "
        f"10%), {cached[0]:.1%} with the hardware profile cached; searched plans: {shares[0]:.1%}"
    )
    assert (
        summary(rows[1:]).splitlines()[1:]
        == [  # (no searched plan, no hardware profile measured)
            f"profiling, hardware profile and search: at most {max(shares[1:]):.1%} of the first 100 steps (target "
            f"under 10%), {max(shares[1:]):.1%} with the hardware profile cached; searched plans: -"
        ]
    )
    cpu = _row(10.5, measured_s=0.1)  # the CPU measures no peak: its peak is left out of the count
    cpu["graphs"][0]["predicted_vs_measured"].update(measured_peak_bytes=None, peak_error=None)
    assert summary([cpu, rows[1]]).splitlines()[0] == (
        "step time within 5%: 2 of 2; peak within 5% and never under by 2%: 1 of 1"
    )


def test_summary_ranks_plans_by_their_medians_over_rounds():
    """`--rounds`: each plan's median over its rounds, by the step monitor and by the harness's steps apart."""
    rows = []
    for r, (searched, forced, harness) in enumerate([(0.100, 0.101, 0.2), (0.130, 0.099, 0.1), (0.102, 0.100, 0.1)]):
        rows += [_row(10.5, measured_s=searched, forced={}), _row(10.5, measured_s=forced)]
        rows[-1]["result"]["step_time_s"] = harness  # (the forced plan's steps after the monitor's)
        for row in rows[-2:]:
            row["round"] = r
    # medians: searched 0.102 (monitor and harness), forced 0.100 (monitor) and 0.1 (harness)
    assert summary(rows).splitlines()[1] == (
        "searched plan against the fastest forced one: +2.0% by the step monitor, +2.0% by the harness's steps "
        "(medians of 3 rounds)"
    )


def _toy_dump(tmp_path, master="float32"):
    """A dump of the toy model trained with one of three chunks persistent, long enough for the step monitor
    (with bfloat16 masters: the model in bfloat16)."""
    model = models.build("toy", layers=3).to(getattr(torch, master))
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    plan = {"n_persist": 1, "n_buffer": 2, "master_dtype": master}
    options = {"executor": "eager", "dump_dir": str(tmp_path), "plan": plan}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    train(compiled, "toy", 9, opt=opt)  # the step monitor reports after 8
    return tmp_path / "rank0" / "graph0"


def test_from_dump_plans_dumped_graphs_again(tmp_path, capsys):
    """`python -m bench from-dump`: each dumped graph's plan then and now, beside its measured steps."""
    _toy_dump(tmp_path)
    assert from_dump(argparse.Namespace(dumps=[str(tmp_path)], plan="", host_as_measured=False)) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith(str(tmp_path / "rank0" / "graph0")) and "1/2/0/0/0 / 1/2/0/0/0" in row
    then, now, measured = (float(x) for x in row.split("|")[2:5])
    assert then == now and measured > 0
    with pytest.raises(SystemExit, match="no planning.json below"):
        from_dump(argparse.Namespace(dumps=[str(tmp_path / "rank0" / "graph0" / "nothing")], plan=""))


@pytest.mark.parametrize("master", ["float32", "bfloat16"])
def test_a_dump_is_timed_again_at_the_host_rate_training_measured(tmp_path, capsys, master):
    """`--host-as-measured`: the plan that ran, timed with the host's work scaled by the rate training measured
    over the plan's predicted rate (its mean over the updates, at the rates beside the copies predicted there,
    for the plan's master dtype: bfloat16 masters' AdamW has its own). On the CPU everything runs in line, so a
    host 10x slower adds nine times the host's share of the step. A report written before the predicted rate was
    kept gets it from the dumped plan."""
    from protrain_fx.debug.from_dump import host_scale_of, plan_from_dump
    from protrain_fx.planner.plan import MASTER_BYTES
    from protrain_fx.profiler.hardware import HardwareProfile

    folder = _toy_dump(tmp_path, master)
    report = json.loads((folder / "predicted_vs_measured.json").read_text())
    hardware = HardwareProfile.from_json(json.loads((folder / "planning.json").read_text())["hardware"])
    assert report["profiled_host_adam_s_per_param"] == [
        hardware.host_adam_s(False, False, MASTER_BYTES[master]),
        hardware.host_adam_s(True, True, MASTER_BYTES[master]),
    ]
    predicted = json.loads((folder / "plan.json").read_text())["predicted_host_adam_s_per_param"]
    assert predicted > 0 and report["predicted_host_adam_s_per_param"] == predicted
    scale = host_scale_of(folder)
    assert scale == pytest.approx(report["measured_host_adam_s_per_param"] / predicted)
    base, slow = (plan_from_dump(folder, host_scale=s) for s in (1.0, 10.0))
    assert base.predicted_step_s == pytest.approx(plan_from_dump(folder).predicted_step_s)
    assert slow.predicted_step_s > base.predicted_step_s
    assert from_dump(argparse.Namespace(dumps=[str(tmp_path)], plan="", host_as_measured=True)) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    at_measured = plan_from_dump(folder, host_scale=scale)
    assert "1/2/0/0/0 / 1/2/0/0/0" in row and float(row.split("|")[3]) == pytest.approx(
        at_measured.predicted_step_s * 1e3, abs=0.05
    )
    del report["predicted_host_adam_s_per_param"]  # (as an older protrain_fx wrote it)
    (folder / "predicted_vs_measured.json").write_text(json.dumps(report))
    assert host_scale_of(folder) == pytest.approx(scale)


def test_each_command_keeps_its_own_run_defaults():
    """maxsize runs 3 steps and no warm-up by default; predict and compare keep theirs (20 and 3: enough for the
    step monitor)."""
    from bench.cli import RUN_FLAGS, _parser

    parser = _parser()
    runs = {cmd: parser.parse_args([cmd]) for cmd in ("maxsize", "predict", "compare")}
    assert (runs["maxsize"].steps, runs["maxsize"].warmup) == (3, 0)
    assert all(
        (runs[c].steps, runs[c].warmup) == (RUN_FLAGS["steps"], RUN_FLAGS["warmup"]) for c in ("predict", "compare")
    )


@pytest.mark.parametrize("cmd, flag", [("predict", "--plans"), ("stability", "--plans"), ("predict", "--replan")])
def test_plan_lists_are_checked_where_they_are_parsed(cmd, flag, capsys):
    """--plans (predict, stability) and --replan take a JSON list of plan dicts, refused otherwise with the form
    they take; --replan also 'on' or 'off'."""
    from bench.cli import _parser

    parser = _parser()
    assert getattr(parser.parse_args([cmd, flag, '[{}, {"n_persist": 4}]']), flag[2:]) == '[{}, {"n_persist": 4}]'
    for bad in ('{"n_persist": 4}', "[4]", "not json"):
        with pytest.raises(SystemExit):
            parser.parse_args([cmd, flag, bad])
        assert "a JSON list of plan dicts" in capsys.readouterr().err
    if flag == "--replan":
        assert parser.parse_args([cmd, flag, "on"]).replan == "on"


def test_rounds_run_the_plans_in_turn(monkeypatch):
    """`--rounds 2`: the whole list, then the whole list again (a drifting host slows every plan alike)."""
    import bench.cli

    plans = []
    monkeypatch.setattr(
        bench.cli, "run_for_result", lambda cmd, system: plans.append(cmd[cmd.index("--plan") + 1]) or {"error": "-"}
    )
    argv = ["predict", "--plans", '[{}, {"n_persist": 1}]', "--out", "", "--rounds", "2"]
    assert bench.cli.main(argv) == 1
    assert plans == ["{}", '{"n_persist": 1}', "{}", '{"n_persist": 1}']
    with pytest.raises(SystemExit, match="--rounds must be at least 1"):
        bench.cli.main([*argv[:-1], "0"])


@pytest.mark.parametrize("nproc", [1, 2])
def test_predict_runs_each_plan_on_nproc_ranks(monkeypatch, nproc):
    """`--nproc N` starts each plan's worker under torchrun with N ranks (one process without it)."""
    import bench.cli

    commands = []
    monkeypatch.setattr(bench.cli, "run_for_result", lambda cmd, system: commands.append(cmd) or {"error": "none"})
    argv = ["predict", "--plans", '[{}, {"n_persist": 1}]', "--out", "", "--nproc", str(nproc)]
    assert bench.cli.main(argv) == 1  # (every plan "failed": no worker ran)
    assert len(commands) == 2
    for cmd in commands:
        launched = "torch.distributed.run" in cmd and f"--nproc_per_node={nproc}" in cmd
        assert launched == (nproc > 1), cmd
        assert cmd[cmd.index("--system") + 1] == "protrain-chunks"


def test_in_turn_runs_the_plans_in_one_worker_and_reports_each(tmp_path, capsys):
    """`--in-turn`: one worker a round; the searched plan compiled, then `n_checkpoint` 1 and the searched plan again
    switched to in turn; a row each, with the monitor's report, the harness's median of that plan's own steps and
    what its switch took.
    Too few steps for every plan to measure its own is refused before any worker starts."""
    from bench.cli import main
    from bench.predict import MONITOR_STEPS

    tiny = "--hidden 32 --layers 2 --intermediate 64 --heads 4 --vocab 96 --seq 16 --batch 2 --dtype float32"
    plans = '[{}, {"n_checkpoint": 1}, {}]'
    out = tmp_path / "predict.json"
    argv = ["predict", *tiny.split(), "--plans", plans, "--in-turn", "--executor", "eager", "--warmup", "1"]
    assert main([*argv, "--steps", str(3 * MONITOR_STEPS), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["forced"] for r in rows] == json.loads(plans) and all(r["round"] == 0 for r in rows)
    fields = [r["graphs"][0]["plan"] for r in rows]
    assert fields[1]["n_checkpoint"] == 1 and fields[0] == fields[2] and fields[0]["n_checkpoint"] == 0
    for row in rows:
        assert row["graphs"][0]["predicted_vs_measured"]["measured_step_s"] > 0 < row["result"]["step_time_s"]
    # each switch's cost: the step holding it over the plan's median, and of that step the backend's placing and
    # compiling
    assert "switch" not in rows[0]["graphs"][0]
    for row in rows[1:]:
        took, step = row["graphs"][0]["switch"], row["result"]["step_time_s"]
        assert (
            took["step_s"] + step > took["placed_s"] + took["compiled_s"] > 0 and took["compiled_s"] > took["placed_s"]
        )
    out = capsys.readouterr().out
    assert "searched plan against the fastest forced one" in out and out.count("switched to in ") == 2
    with pytest.raises(
        SystemExit, match=rf"--in-turn with 3 plans needs --warmup \+ --steps >= {3 * MONITOR_STEPS + 1}"
    ):
        main([*argv, "--steps", str(3 * MONITOR_STEPS - 1)])
