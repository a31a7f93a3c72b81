"""bench sweep and maxsize: the bisection finds the largest trainable size; a sweep runs on CPU at tiny sizes."""

import json

import pytest

from bench.sweep import LADDER, _params, _spec, bisect_largest, ladder_of


def test_bisection_finds_the_largest_trainable_size_in_few_tries():
    ladder = list(range(15))
    for limit in range(-1, 15):  # -1: nothing trains
        largest, tried = bisect_largest(ladder, lambda size, limit=limit: size <= limit)
        assert largest == (limit if limit >= 0 else None)
        assert len(tried) <= 4 and all(ok == (size <= limit) for size, ok in tried)


def test_ladder_grows():
    class Args:
        vocab, seq, family = 32000, 1024, "llama"

    sizes = [_params(_spec(Args, *entry)) for entry in LADDER]
    assert sizes == sorted(sizes) and 1.5e9 < sizes[0] < 2.5e9 and sizes[-1] > 70e9


def test_ladder_option_picks_entries_in_ladder_order():
    assert ladder_of("") == LADDER
    assert ladder_of("4096x40,4096x32") == [(4096, 11008, 32, 32), (4096, 11008, 32, 40)]
    with pytest.raises(SystemExit, match=r"\['4096x33'\] are not in the ladder"):
        ladder_of("4096x32,4096x33")


def test_maxsize_report_keeps_why_a_size_failed(tmp_path, monkeypatch):
    """The bisection over the named ladder entries, with each worker's outcome faked: the report holds the
    largest that trained and, for each size tried, whether it trained, why not, and its memory peaks."""
    import bench.cli

    def fake_worker(system, args, nproc=1):
        if args.layers > 32:
            return {"error": "worker exited with code -9"}
        return {"losses": [10.0, 9.5, 9.0], "peak_gpu_bytes": 1, "peak_rss_bytes": 2, "plan": None}

    monkeypatch.setattr(bench.cli, "_run_worker", fake_worker)
    out = tmp_path / "maxsize.json"
    argv = ["maxsize", "--systems", "eager", "--ladder", "4096x26,4096x32,4096x40", "--out", str(out)]
    assert bench.cli.main(argv) == 0
    report = json.loads(out.read_text())["systems"]["eager"]
    assert report["largest"]["layers"] == 32 and report["params"] > 6e9
    tried = {t["spec"]["layers"]: (t["trains"], t["error"], t["peak_rss_bytes"]) for t in report["tried"]}
    assert tried == {32: (True, None, 2), 40: (False, "worker exited with code -9", None)}


def test_sweep_on_cpu(tmp_path, capsys):
    """The command's own code in this process (`python -m bench` calls `main`), each size's worker a process."""
    from bench.cli import main

    out = tmp_path / "sweep.json"
    tiny = "--hidden 32 --layers 2 --intermediate 64 --heads 4 --vocab 96 --seq 16 --steps 1 --warmup 0 --dtype float32"
    assert main(["sweep", "--systems", "eager", "--batches", "1,2", *tiny.split(), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "best tokens/s" in printed and "eager" in printed
    results = json.loads(out.read_text())["results"]["eager"]
    assert set(results) == {"1", "2"} and all(r["tokens_per_s"] > 0 for r in results.values())


def test_scaling_on_two_cpu_ranks(tmp_path, capsys):
    """protrain-chunks under torchrun with 2 gloo ranks: the total tokens/s and the efficiency against 1 rank. A
    system that trains each rank alone is refused before any worker starts."""
    from bench.cli import main

    out = tmp_path / "scaling.json"
    tiny = "--hidden 32 --layers 2 --intermediate 64 --heads 4 --vocab 96 --seq 16 --steps 2 --warmup 1 --dtype float32"
    argv = ["scaling", "--systems", "protrain-chunks", "--gpus", "1,2", *tiny.split()]
    assert main([*argv, "--executor", "eager", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]["protrain-chunks"]
    assert [results[n]["world_size"] for n in ("1", "2")] == [1, 2]
    assert "%)" in capsys.readouterr().out.splitlines()[-1]
    with pytest.raises(SystemExit, match="train each rank alone"):
        main([*argv[:2], "eager", *argv[3:]])


def test_plot_of_compare_reports(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.cli import main

    for size, speed in ((1e9, 70000.0), (5.5e9, 12000.0)):
        results = [
            {"system": s, "params": size, "tokens_per_s": speed * k} for s, k in (("protrain", 1), ("fsdp2", 0.3))
        ]
        (tmp_path / f"{size}.json").write_text(json.dumps({"device": "H100", "results": results}))
    out = tmp_path / "plot.png"
    assert main(["plot", *map(str, sorted(tmp_path.glob("*.json"))), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
