"""The plan cache (protrain_fx/backend/cache.py): a relaunch with nothing changed profiles and searches nothing and
starts with the plan the last run ended with; a change recomputes what depends on it; an entry that cannot be read
is ignored with a warning. And the phase lines a batch job's log gets (protrain_fx/backend/phases.py).

Relaunches are fresh processes (`_run`, running `_child`) where the test is about a relaunch as a user makes one;
elsewhere a second compile in this process after `torch._dynamo.reset()`, which reads the entry from disk as a
relaunch does. Planning uses a fixed hardware profile (cost_models.H100_LIKE), not one measured under the tests'
load. Tolerance: bitwise (the eager executor, fp32 on the CPU: the same plan runs the same aten ops).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import models
import pytest
import torch
from cost_models import H100_LIKE
from spawn import collect_less, spawn_gloo

import protrain_fx
from protrain_fx.backend import cache as cache_module
from protrain_fx.backend import partition as partition_module
from protrain_fx.backend import phases
from protrain_fx.backend import planning as planning_module
from protrain_fx.backend import stages as stages_module
from protrain_fx.config import ProTrainConfig
from protrain_fx.runtime.monitor import MEASURED_STEPS, WARMUP_STEPS

TESTS = Path(__file__).resolve().parent
SWITCH_AT = WARMUP_STEPS + MEASURED_STEPS + 1  # the step whose forward the closed loop switches at (test_replan.py)
SWITCH_TO = {"n_persist": 1, "n_buffer": 2, "n_checkpoint": 1}  # chunks to the host, a block checkpointed
SHAPE = (2, 64)
# the digest of the package's source the key holds (cache.source_digest), fixed: a file of the package edited
# between two compiles of a test (a checkout being worked on) would make the second a miss
SOURCE = "source of the test"


def _counted(counts: dict[str, int], patch=setattr, searching=None) -> None:
    """Count the profiled iterations and the searches in `counts`: planning's, and the closed loop's unless
    `searching` names the modules whose searches count; `patch`: how (monkeypatch.setattr in a test process)."""
    from protrain_fx.planner import calibrate, search
    from protrain_fx.runtime import replan

    profile, plan_graph = stages_module.profile_iteration, search.plan_graph

    def profiled(*args, **kwargs):
        counts["profiles"] += 1
        return profile(*args, **kwargs)

    def searched(*args, **kwargs):
        counts["searches"] += 1
        return plan_graph(*args, **kwargs)

    patch(stages_module, "profile_iteration", profiled)
    for module in searching or (planning_module, calibrate, replan):
        patch(module, "plan_graph", searched)


def _switch_to(fields: dict) -> None:
    """The closed loop's search replaced by one that forces `fields` and calls the switch worth it."""
    from protrain_fx.planner import search
    from protrain_fx.planner.calibrate import Replan
    from protrain_fx.runtime import replan

    plan_graph = search.plan_graph

    def replanned(costs, inputs, plan, forced, *, headroom=0.0):
        chosen = plan_graph(costs, {**forced, **fields}, inputs.layout, inputs.capacity_bytes, inputs.host_bytes)
        return Replan(chosen, plan, ranked_s=0.5, before_ranked_s=1.0, margin=0.05)

    replan.replanned = replanned


def _child(args: dict) -> None:
    """A training run in a process of its own (`_run`): the llama (or the `model` kind of tests/models.py),
    protrain's AdamW, the eager executor (or `executor`), `steps` steps; prints as its last line what it profiled, searched and trained, and inductor's FX
    graph cache counts."""
    from torch._dynamo.utils import counters

    from protrain_fx.planner.plan import decisions

    collect_less()
    counts = {"profiles": 0, "searches": 0}
    _counted(counts)
    planning_module.hardware_profile = lambda device: H100_LIKE
    cache_module.source_digest = lambda: SOURCE  # (the package's files as the test's first run read them)
    if args.get("switch_to"):
        _switch_to(args["switch_to"])
    kind = args.get("model", "llama")
    model = models.llama4() if kind == "llama" else models.build(kind)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    backend = protrain_fx.ProTrainBackend({"executor": args.get("executor", "eager"), **args.get("options", {})})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    losses, plans = [], []
    for step in range(args["steps"]):
        loss = models.loss_of(kind, compiled(**models.batch(kind, *SHAPE, seed=step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        plans.append(decisions(protrain_fx.plan_of(compiled).to_json()))
    state = protrain_fx.full_state_dict(model)
    digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
    said = str(protrain_fx.plan_of(compiled)).splitlines()[0]
    record = backend.graphs[0]
    out = {"counts": counts, "losses": losses, "plans": plans, "state": digest, "plan_of": said}
    out["fxgraph"] = {k.removeprefix("fxgraph_cache_"): v for k, v in counters["inductor"].items() if "fxgraph" in k}
    print(json.dumps({**out, "from_cache": list(record.from_cache), "seconds": sorted(record.seconds)}))


def _run(cache_dir: Path, steps: int, *, cache: str = "on", **args) -> tuple[dict, str]:
    """`_child` in a fresh Python process whose plan cache, and inductor's caches, are in `cache_dir` (this
    test's environment unchanged): what it printed, and its stderr (a pipe: no terminal)."""
    env = dict(os.environ, PROTRAIN_CACHE_DIR=str(cache_dir), PROTRAIN_PLAN_CACHE=cache)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    payload = json.dumps({"steps": steps, **args})
    code = f"import json, test_plan_cache; test_plan_cache._child(json.loads({payload!r}))"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=TESTS, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_relaunch_profiles_and_searches_nothing_and_trains_like_the_plan_it_starts_with(tmp_path):
    """The first run profiles, searches, and its closed loop switches (forced: `_switch_to`); the relaunch starts
    with the plan switched to, with no profile and no search (not even the closed loop's), and trains bitwise like
    a run that forces that plan; each run's log shows the phases with their times, or that they came from the
    cache."""
    cache = tmp_path / "cache"
    first, first_log = _run(cache, SWITCH_AT + 1, switch_to=SWITCH_TO)
    assert first["counts"]["profiles"] == 1 and first["counts"]["searches"] >= 1
    assert first["plans"][0] != first["plans"][-1] and all(first["plans"][-1][k] == v for k, v in SWITCH_TO.items())
    assert first["from_cache"] == [] and "profile" in first["seconds"]
    for line in ("captured in", "profiled in", "searched in", "plan n_persist="):
        assert f"protrain: graph 0: {line}" in first_log, first_log[-3000:]
    assert first_log.count("protrain: graph 0: plan n_persist=") == 1  # (the switch is the closed loop's warning)
    (entry,) = (cache / cache_module.PLANS_DIR).iterdir()

    again, again_log = _run(cache, 4)
    assert again["counts"] == {"profiles": 0, "searches": 0}
    assert all(plan == first["plans"][-1] for plan in again["plans"])  # the plan the first run ended with
    assert again["from_cache"] == ["profile", "plan", "closed loop"] and "profile" not in again["seconds"]
    assert again["plan_of"] == "from the plan cache of an earlier run: profile, plan, closed loop"
    assert f"profile from the plan cache ({entry})" in again_log and f"plan from the plan cache ({entry})" in again_log

    forced, _ = _run(tmp_path / "another", 4, cache="off", options={"plan": again["plans"][0]})
    assert forced["counts"]["profiles"] == 1 and forced["plans"] == again["plans"]
    assert forced["losses"] == again["losses"] and forced["state"] == again["state"]
    assert not (tmp_path / "another" / cache_module.PLANS_DIR).exists()  # (off: nothing kept)


def test_a_relaunch_takes_the_compiled_graphs_from_inductors_cache(tmp_path):
    """With the inductor executor, a relaunch rewrites the graphs as the first run did, so inductor's FX graph
    cache gives both compiled graphs (nothing bypasses it), and the relaunch's steps are the first run's."""
    first, _ = _run(tmp_path, 2, executor="inductor", model="toy")
    assert first["fxgraph"] == {"miss": 2}, first["fxgraph"]
    again, _ = _run(tmp_path, 2, executor="inductor", model="toy")
    assert again["fxgraph"] == {"hit": 2} and again["counts"] == {"profiles": 0, "searches": 0}
    assert again["losses"] == first["losses"]


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The plan cache on, in a directory of this test's; the fixed hardware profile; the profiles and searches
    counted (a dict, read after each compile)."""
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PROTRAIN_PLAN_CACHE", "on")
    monkeypatch.setattr(planning_module, "hardware_profile", lambda device: H100_LIKE)
    monkeypatch.setattr(cache_module, "source_digest", lambda: SOURCE)
    counts = {"profiles": 0, "searches": 0}
    _counted(counts, monkeypatch.setattr, searching=(planning_module,))
    return counts


def _compile(options=None, batch_size: int = 2, dynamic=False, seq: int = 16):
    """A fresh toy model compiled as a relaunch would (Dynamo reset), one step; its graph's record (of the graph
    with the parameters)."""
    torch._dynamo.reset()
    model = models.build("toy")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", **(options or {})})
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    compiled(**models.batch("toy", batch_size, seq)).backward()
    opt.step()
    return max(backend.graphs, key=lambda g: len(g.param_map)), compiled


def _differs(counts: dict, options=None, **kw) -> tuple[int, int]:
    """(profiles, searches) a compile made."""
    before = dict(counts)
    _compile(options, **kw)
    return counts["profiles"] - before["profiles"], counts["searches"] - before["searches"]


def test_what_changed_is_computed_again_and_nothing_else(counted, monkeypatch):
    """The same graph again: nothing. Another batch size: its own profile and plan. A plan field given: searched
    again on the kept profile. The model's code changed: profiled and searched again."""
    assert _differs(counted) == (1, 1)
    assert _differs(counted) == (0, 0)
    assert _differs(counted, batch_size=3) == (1, 1)
    assert _differs(counted, batch_size=3) == (0, 0)
    assert _differs(counted, {"plan": {"n_checkpoint": 1}}) == (0, 1)
    assert _differs(counted, {"plan": {"n_checkpoint": 1}}) == (0, 0)
    forward = models.ToyBlock.forward
    monkeypatch.setattr(models.ToyBlock, "forward", lambda self, x: forward(self, x) * 0.5)
    assert _differs(counted) == (1, 1)
    assert _differs(counted) == (0, 0)


def test_the_key_holds_the_world_size(counted, monkeypatch):
    """A unit test of the key: the same graph on two ranks is another entry (its profile is every rank's most)."""
    seen = []
    real = partition_module.open_cache
    monkeypatch.setattr(partition_module, "open_cache", lambda *a: seen.append(a) or real(*a))
    _compile()
    one = cache_module.graph_key(*seen[0])
    monkeypatch.setattr("protrain_fx.profiler.hardware.rank_and_world_size", lambda: (0, 2))
    two = cache_module.graph_key(*seen[0])
    assert one["machine"]["world_size"] == 1 and two["machine"]["world_size"] == 2
    assert {k for k in one if one[k] != two[k]} == {"machine"}


@pytest.mark.parametrize("damage", ["partial", "not json", "wrong profile", "wrong plan"])
def test_an_entry_that_cannot_be_read_is_ignored_with_a_warning(counted, tmp_path, caplog, damage):
    _compile()
    (path,) = (tmp_path / cache_module.PLANS_DIR).iterdir()
    text = path.read_text()
    entry = json.loads(text)
    if damage == "partial":
        path.write_text(text[: len(text) // 2])
    elif damage == "not json":
        path.write_bytes(b"\x00\xff" * 16)
    elif damage == "wrong profile":
        entry["profiles"][0]["profile"] = {"nodes": 3}
        path.write_text(json.dumps(entry))
    else:
        entry["results"][0]["plan"]["block_modes"] = None
        entry["results"][0]["plan"]["no_such_field"] = 1
        path.write_text(json.dumps(entry))
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        record, _ = _compile()
    assert f"plan cache {path}" in caplog.text
    assert (counted["profiles"], counted["searches"]) == ((1, 2) if damage == "wrong plan" else (2, 2))
    assert record.plan is not None and json.loads(path.read_text())["results"]  # (written again, whole)
    assert _differs(counted) == (0, 0)


def test_off_keeps_nothing_and_reads_nothing(counted, tmp_path):
    _compile()
    assert _differs(counted, {"plan_cache": "off"}) == (1, 1)
    record, _ = _compile({"plan_cache": "off"})
    assert record.cache is None and record.from_cache == ()
    with pytest.raises(ValueError, match=r"option 'plan_cache' .* must be one of \['on', 'off'\]"):
        ProTrainConfig.from_options({"plan_cache": True})


def test_plan_of_and_explain_say_what_came_from_the_cache(counted):
    record, compiled = _compile()
    assert record.from_cache == () and "plan cache" not in str(protrain_fx.plan_of(compiled))
    record, compiled = _compile()
    assert record.from_cache == ("profile", "plan")
    assert str(protrain_fx.plan_of(compiled)).startswith("from the plan cache of an earlier run: profile, plan\n")
    explained = [str(protrain_fx.explain(models.build("toy"), models.batch("toy"))) for _ in range(2)]
    assert "plan cache" not in explained[0] and "graph 0: from the plan cache of an earlier run" in explained[1]


def test_symbolic_sizes_keep_both_profiles_and_the_plan(counted):
    """A graph with symbolic sizes: its two profiles come back (the fit made again from them) and its plan, for the
    same first sizes; other first sizes profile again."""
    first, _ = _compile(dynamic=True)
    assert first.fit is not None and _differs(counted, dynamic=True) == (0, 0)
    again, _ = _compile(dynamic=True)
    assert again.from_cache == ("profile", "plan") and again.shapes == first.shapes
    at = {s: 2 * v for s, v in first.fit.a.items()}
    assert again.fit.at(at).peak_bytes == first.fit.at(at).peak_bytes
    assert _differs(counted, dynamic=True, seq=24) == (2, 1)


def _agree_on(rank: int, world: int) -> None:
    device = torch.device("cpu")
    assert cache_module._agreed({"a": 1}, device)
    assert not cache_module._agreed({"a": rank}, device)
    assert not cache_module._agreed({"a": 1} if rank == 0 else None, device)
    assert not cache_module._agreed(None, device)


def test_ranks_use_only_what_every_rank_read():
    spawn_gloo(_agree_on, 2)


@pytest.fixture
def progress_restored():
    """The progress logger as it was, after the test."""
    progress = logging.getLogger(phases.PROGRESS_LOGGER)
    yield progress
    for handler in [h for h in progress.handlers if isinstance(h, phases.StderrFallback)]:
        progress.removeHandler(handler)
    progress.setLevel(logging.NOTSET)
    progress.propagate = True


def test_phase_lines_reach_stderr_only_where_nothing_else_would_show_them(progress_restored, monkeypatch):
    """A program that configured no logging (pytest's handlers set aside), whose stderr is no terminal."""
    import io

    progress, stderr = progress_restored, io.StringIO()
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(sys, "stderr", stderr)
    phases.phase_done(0, "profile", 1.5)
    assert stderr.getvalue() == "protrain: graph 0: profiled in 1.50 s\n"
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])  # (the program configures logging)
    phases.phase_done(0, "search", 0.25)
    assert stderr.getvalue().count("\n") == 1 and progress.handlers == [] and progress.propagate
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(progress, "level", logging.WARNING)  # (the program silences them)
    phases.phase_done(0, "search", 0.25)
    assert stderr.getvalue().count("\n") == 1


def test_a_plan_searched_for_another_capacity_is_searched_again(counted, monkeypatch):
    """The capacities are no part of the key: a result holds within CAPACITY_SLACK of those it was searched
    under."""
    gpu = 2**30
    assert _differs(counted, {"gpu_memory_bytes": gpu}) == (1, 1)
    assert _differs(counted, {"gpu_memory_bytes": int(gpu * (1 + cache_module.CAPACITY_SLACK / 2))}) == (0, 0)
    assert _differs(counted, {"gpu_memory_bytes": 2 * gpu}) == (0, 1)
