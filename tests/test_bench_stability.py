"""`python -m bench stability` (bench/stability.py): how far one model's plan and predicted step move between its
profiles, from dumps of earlier runs (the recorded dump of tests/test_search_recorded.py, once as it is and once with
its timings changed) and from profiles it takes itself, each in a worker process (on the CPU at a tiny size)."""

import dataclasses
import gzip
import json
import shutil
from pathlib import Path

import pytest

from bench.cli import main
from bench.stability import analyse, format_report, graph_folders
from protrain_fx.planner.search import SEARCHED
from protrain_fx.profiler.profile import GraphProfile, aggregate_blocks

RECORDED = Path(__file__).parent / "data" / "llama4_cpu"
TINY = "--hidden 32 --layers 2 --intermediate 64 --heads 4 --vocab 96 --seq 16 --batch 2 --dtype float32"


def _dump(root: Path, scale: float = 1.0) -> Path:
    """A dump directory holding the recorded graph as rank0/graph0, every node's time `scale` times as long."""
    folder = root / "rank0" / "graph0"
    folder.mkdir(parents=True)
    for packed in RECORDED.glob("*.json.gz"):
        with gzip.open(packed) as src, open(folder / packed.stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    profile = GraphProfile.from_json(json.loads((folder / "profile.json").read_text()))
    nodes = [dataclasses.replace(n, latency_s=n.latency_s * scale) for n in profile.nodes]
    scaled = dataclasses.replace(
        profile,
        nodes=nodes,
        blocks=aggregate_blocks(nodes),
        forward_s=profile.forward_s * scale,
        backward_s=profile.backward_s * scale,
    )
    (folder / "profile.json").write_text(json.dumps(scaled.to_json()))
    return root


def test_dumps_of_one_model_compared(tmp_path):
    """Two identical profiles predict every plan alike and choose the same plans; a profile whose every node ran
    twice as long predicts each plan slower, by up to twice (the copies and the host run at the hardware profile's
    rates), and the spread says by how much, the same on the first profile's hardware profile (both have one)."""
    same = [_dump(tmp_path / "a"), _dump(tmp_path / "b")]
    [(graph, folders)] = graph_folders(same).items()
    report = analyse(graph, folders, [{"n_persist": 2}], [1.0, 0.5, 0.0])
    assert graph == "graph0" and not report["searched_changed"] and report["spread"] == [0.0, 0.0]
    assert [c["changed"] for c in report["capacities"]] == [False] * 3
    assert len({json.dumps(c["searched"][0]) for c in report["capacities"]}) > 1  # (choices to make there)
    slower = analyse(graph, [folders[0], _dump(tmp_path / "c", scale=2.0) / "rank0" / "graph0"], [{"n_persist": 2}], [])
    a, b = slower["profiles"]
    assert b["forward_s"] == pytest.approx(2 * a["forward_s"])
    assert all(1.0 < tb / ta <= 2.0 for ta, tb in zip(a["forced_step_s"], b["forced_step_s"]))
    assert slower["spread"] == pytest.approx([tb / ta - 1 for ta, tb in zip(a["forced_step_s"], b["forced_step_s"])])
    assert slower["spread_at_first_hardware"] == pytest.approx(slower["spread"])
    assert report["plans"][0] == {k: report["profiles"][0]["searched"][k] for k in SEARCHED}
    text = format_report(slower)
    assert "searched plan:" in text and f"spread {slower['spread'][1]:.1%}" in text


def test_stability_profiles_a_model_in_worker_processes(tmp_path, capsys):
    """`--profiles 2`: two worker processes each profile and plan the model (explain mode, a dump each); the
    report compares them."""
    out = tmp_path / "stability.json"
    argv = ["stability", "--profiles", "2", *TINY.split(), "--keep-dumps", str(tmp_path / "dumps")]
    assert main([*argv, "--plans", '[{"n_checkpoint": 1}]', "--executor", "eager", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    [graph] = report["graphs"]
    assert len(graph["profiles"]) == 2 and all(r["forward_s"] > 0 for r in graph["profiles"])
    assert [p["plan"] for p in report["profiles"]] == [r["searched"] for r in graph["profiles"]]
    assert graph["plans"][1] == {"n_checkpoint": 1} and all(len(r["forced_step_s"]) == 2 for r in graph["profiles"])
    assert "searched plan:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="need --profiles >= 2"):
        main(["stability", "--profiles", "1", *TINY.split()])
