"""explain, plan_of, manager_of, the plan dump and its replay, predicted_vs_measured.json (protrain_fx/explain.py,
runtime/monitor.py)."""

import collections
import copy
import dataclasses
import json
import re
import types

import models
import pytest
import torch
from helpers import train

import protrain_fx
from protrain_fx.planner.plan import Plan

REQUIRED = (
    "n_persist n_buffer n_swap n_checkpoint n_chunk n_block chunk_bytes block_modes predicted_step_s "
    "predicted_peak_bytes runners_up"
).split()


def test_explain_plans_without_training_or_moving_anything():
    model = models.build("llama", layers=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = protrain_fx.explain(model, models.batch("llama"), {"executor": "eager"})
    assert isinstance(plan, Plan) and all(hasattr(plan, f) for f in REQUIRED)
    assert plan.n_chunk > 1 and plan.n_block == 4 and plan.predicted_step_s > 0 and plan.predicted_peak_bytes > 0
    assert len(plan.runners_up) == 3
    table = str(plan)
    assert "runner-up 3" in table and "predicted_step_s" in table and "ms" in table
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(k.startswith("_protrain") for k in model.__dict__)  # no chunks, no plan in force


def test_explain_under_inductor_generates_no_kernels_and_plans_as_training_does(monkeypatch):
    """To explain, inductor decomposes the graph and our partitioner profiles and plans it as in training, but no
    kernels are generated for the one forward explain runs (`compile_fx_inner` is training's alone): the plan is
    training's (on the CPU every chunk persistent, the predicted peak that of the same graph)."""
    from torch._inductor import compile_fx

    model = models.build("llama", layers=2)
    trained = copy.deepcopy(model)
    inner, compiled_graphs = compile_fx.compile_fx_inner, []
    monkeypatch.setattr(compile_fx, "compile_fx_inner", lambda *a, **k: compiled_graphs.append(1) or inner(*a, **k))
    explained = protrain_fx.explain(model, models.batch("llama"))
    assert not compiled_graphs
    protrain_fx.optim.AdamW(trained.parameters(), lr=1e-3)
    torch._dynamo.reset()
    compiled = torch.compile(trained, backend="protrain", dynamic=False)
    compiled(**models.batch("llama")).loss.backward()
    assert compiled_graphs  # (training's graphs are inductor's kernels)
    plan = protrain_fx.plan_of(compiled)
    fields = ("n_chunk", "n_block", "n_persist", "block_modes", "predicted_peak_bytes")
    assert {f: getattr(explained, f) for f in fields} == {f: getattr(plan, f) for f in fields}


def test_explain_takes_positional_batches_and_says_what_is_wrong():
    model = models.build("toy", layers=2)
    batch = models.batch("toy")
    plan = protrain_fx.explain(model, tuple(batch.values()), {"executor": "eager"})
    assert plan.n_block == 2
    with pytest.raises(TypeError, match="example_batch must be a dict"):
        protrain_fx.explain(model, [1, 2], {"executor": "eager"})
    with pytest.raises(TypeError, match="takes the model"):
        protrain_fx.explain(lambda x: x, batch)


def test_explain_says_which_block_lists_it_found():
    """Printed, the plan says which block lists capture found (paths, lengths, their block indices) and how many
    graph nodes lie outside them: an encoder-decoder's two stacks, a decoder's one list."""
    plan = protrain_fx.explain(models.build("t5", layers=2), models.batch("t5"), {"executor": "eager"})
    first = str(plan).splitlines()[0]
    assert first.startswith(
        "graph 0: block lists encoder.block (2 x T5Block, blocks 0-1), decoder.block (2 x T5Block, blocks 2-3); "
    )
    outside, nodes = (int(x) for x in re.search(r"(\d+) of (\d+) graph nodes outside them", first).groups())
    assert 0 < outside < nodes and re.search(r"\(pre \d+, between \d+, post \d+\)$", first)
    assert plan.n_block == 4 and "n_persist" in str(plan)
    assert "graph 0" not in json.dumps(plan.to_json())  # (what capture found is no plan field)
    llama = protrain_fx.explain(models.build("llama", layers=3), models.batch("llama"), {"executor": "eager"})
    assert str(llama).startswith("graph 0: block lists model.layers (3 x LlamaDecoderLayer, blocks 0-2); ")


def test_plan_of_the_compiled_model():
    """plan_of, and manager_of: the chunks of the plan in force."""
    model = models.build("llama", layers=2)
    compiled = torch.compile(model, backend="protrain", options={"executor": "eager"})
    with pytest.raises(ValueError, match=r"run one training step (?s:.*) call torch._dynamo.reset\(\) before"):
        protrain_fx.plan_of(compiled)
    assert protrain_fx.manager_of(compiled) is None
    with pytest.raises(TypeError, match=r"manager_of\(\) takes the model"):
        protrain_fx.manager_of("model")
    protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    compiled(**models.batch("llama")).loss.backward()
    plan = protrain_fx.plan_of(compiled)
    assert plan.n_chunk > 1 and plan.n_persist == plan.n_chunk  # (the CPU: no capacity to save memory for)
    assert protrain_fx.plan_of(model) is plan
    manager = protrain_fx.manager_of(compiled)
    assert manager is protrain_fx.manager_of(model) and manager.layout.n_chunk == plan.n_chunk


def test_dumped_plan_replays_without_search_and_is_measured(tmp_path):
    """The dump has plan.json, and after a few steps predicted_vs_measured.json (with the host AdamW's rate in
    training beside the hardware profile's, chunks being offloaded, and the plan's step time at that rate);
    plan.json given back as options={"plan": path} is the same plan, not searched again."""
    from protrain_fx.debug.from_dump import host_scale_of, plan_from_dump
    from protrain_fx.planner.plan import decisions

    model = models.build("llama", layers=3)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"executor": "eager", "dump_dir": str(tmp_path), "plan": {"n_checkpoint": 1, "n_persist": 1}}
    backend = protrain_fx.ProTrainBackend(options)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    train(compiled, "llama", 8, opt=opt)
    graph_dir = tmp_path / "rank0" / "graph0"
    dumped = json.loads((graph_dir / "plan.json").read_text())
    assert dumped["n_checkpoint"] == 1 and dumped["runners_up"]
    report = json.loads((graph_dir / "predicted_vs_measured.json").read_text())
    assert report["measured_step_s"] > 0 and report["predicted_step_s"] == dumped["predicted_step_s"]
    assert report["clipped"] is False
    assert report["measured_peak_bytes"] is None  # no allocator on the CPU
    assert dumped["n_persist"] < dumped["n_chunk"] and report["measured_host_adam_s_per_param"] > 0
    hardware = json.loads((graph_dir / "planning.json").read_text())["hardware"]
    assert report["profiled_host_adam_s_per_param"] == [
        hardware["host_adam_s_per_param"],
        hardware["host_adam_both_s_per_param"],
    ]
    # the plan timed again with the host as fast as measured, as `bench from-dump --host-as-measured` times it
    assert report["predicted_host_adam_s_per_param"] == dumped["predicted_host_adam_s_per_param"] > 0
    again = plan_from_dump(graph_dir, decisions(dumped), host_scale=host_scale_of(graph_dir))
    assert report["predicted_step_s_at_measured_host"] == pytest.approx(again.predicted_step_s)
    assert report["predicted_step_s_at_measured_host"] != pytest.approx(report["predicted_step_s"])
    expected = (again.predicted_step_s - report["measured_step_s"]) / report["measured_step_s"]
    assert report["step_error_at_measured_host"] == pytest.approx(expected)

    torch._dynamo.reset()
    fresh = models.build("llama", layers=3)
    protrain_fx.optim.AdamW(fresh.parameters(), lr=1e-3)
    replay = protrain_fx.ProTrainBackend({"executor": "eager", "plan": str(graph_dir / "plan.json")})
    torch.compile(fresh, backend=replay, dynamic=False)(**models.batch("llama")).loss.backward()
    plan = replay.graphs[0].plan
    searched = ("n_persist", "n_buffer", "n_swap", "n_checkpoint", "block_modes", "n_chunk", "chunk_bytes")
    assert all(getattr(plan, f) == (tuple(dumped[f]) if f == "block_modes" else dumped[f]) for f in searched)
    assert plan.runners_up == ()  # every field given: nothing searched


def test_clipped_steps_are_measured_against_the_clipped_prediction(tmp_path):
    """A model whose gradients are clipped every step runs its offloaded updates in another order than one that is
    not (runtime/clip.py): predicted_vs_measured.json sets its steps beside the plan's clipped prediction."""
    model = models.build("llama", layers=3)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"executor": "eager", "dump_dir": str(tmp_path), "plan": {"n_persist": 1}}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    train(compiled, "llama", 8, opt=opt, before_step=lambda step: protrain_fx.clip_grad_norm_(compiled, 1e9))
    graph_dir = tmp_path / "rank0" / "graph0"
    dumped = json.loads((graph_dir / "plan.json").read_text())
    report = json.loads((graph_dir / "predicted_vs_measured.json").read_text())
    # (on the CPU, which overlaps nothing, the two predictions are equal: the GPU run in docs/benchmarks.md differs)
    assert report["clipped"] is True and report["predicted_step_s"] == dumped["predicted_clipped_step_s"]
    expected = (dumped["predicted_clipped_step_s"] - report["measured_step_s"]) / report["measured_step_s"]
    assert report["step_error"] == pytest.approx(expected)


def test_a_dump_is_planned_again_without_the_model(tmp_path):
    """planning.json and profile.json of a dump are all the planner needs: planned again from them (no model, no
    profiling), a graph gets the plan it was given, predictions and runners-up included; other forced fields are
    searched under the dumped capacities. graphs.json classifies every node's kernel again as profiling did: it
    holds the graphs as profiled, not as cut again for the plan (here with a block checkpointed)."""
    from protrain_fx.debug.from_dump import classified_again, plan_from_dump
    from protrain_fx.profiler.profile import GraphProfile

    model = models.build("llama", layers=3)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    options = {
        "executor": "eager",
        "dump_dir": str(tmp_path),
        # (3 buffers: with recompute the chunk a recomputed block reads is in use too, as the search counts)
        "plan": {"n_persist": 1, "n_buffer": 3, "n_checkpoint": 1},
    }
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    compiled(**models.batch("llama")).loss.backward()
    opt.step()
    graph_dir = tmp_path / "rank0" / "graph0"
    dumped = json.loads((graph_dir / "plan.json").read_text())
    assert dumped["n_chunk"] > 2 and dumped["runners_up"]
    assert plan_from_dump(graph_dir).to_json() == dumped
    searched = plan_from_dump(graph_dir, {})
    assert searched.n_chunk == dumped["n_chunk"] and searched.predicted_step_s > 0
    assert plan_from_dump(graph_dir, {"n_persist": 2}).n_persist == 2
    with pytest.raises(ValueError, match="has no profile.json or planning.json: pass a graph folder"):
        plan_from_dump(tmp_path)

    profile = GraphProfile.from_json(json.loads((graph_dir / "profile.json").read_text()))
    graphs = json.loads((graph_dir / "graphs.json").read_text())
    fused = [n for n in profile.nodes if n.fused_bytes]
    assert len(fused) > 10 and any(n.unfused_bytes for n in profile.nodes)
    for node in fused:  # (as found again, not as dumped)
        node.fused_bytes = node.unfused_bytes = 0
        node.kernel = "extern"
    again = classified_again(profile, graphs)
    dumped = GraphProfile.from_json(json.loads((graph_dir / "profile.json").read_text()))
    assert [(n.kernel, n.fused_bytes, n.unfused_bytes) for n in again.nodes] == [
        (n.kernel, n.fused_bytes, n.unfused_bytes) for n in dumped.nodes
    ]


def test_the_plan_budgets_host_memory():
    """Offloaded chunks take host memory (fp32 master, gradient and AdamW states, 16 bytes an element): under a
    GPU budget that offloads chunks and a host budget (`host_memory_bytes`) too small for them, the error says
    how much host memory the plans need; with that much, the plan is found."""
    model, batch = models.build("llama"), models.batch("llama")
    full = protrain_fx.explain(model, batch, {"executor": "eager"})
    tight = {"executor": "eager", "gpu_memory_bytes": int(full.predicted_peak_bytes * 0.9)}
    offloaded = protrain_fx.explain(model, batch, tight)
    assert offloaded.n_persist < offloaded.n_chunk
    with pytest.raises(Exception, match=r"no plan fits the host memory: .* need at least [\d.]+ [GM]iB") as err:
        protrain_fx.explain(model, batch, {**tight, "host_memory_bytes": 2**16})
    needed = err.value.inner_exception.host_needed  # (torch.compile wraps the backend's NoPlanFits)
    plan = protrain_fx.explain(model, batch, {**tight, "host_memory_bytes": needed})
    assert plan.n_persist < plan.n_chunk
    with pytest.raises(ValueError, match=r"option 'host_memory_bytes' must be positive"):
        protrain_fx.explain(model, batch, {"host_memory_bytes": 0})


def test_a_host_adamw_far_from_its_profile_is_reported(caplog):
    """On CUDA, a host AdamW far slower in training than the hardware profile says (a profile measured while the
    machine was busy, then cached) is logged with what to do; within the profile's range it is not."""
    from protrain_fx.profiler.hardware import hardware_profile
    from protrain_fx.runtime.monitor import HOST_RATE_SLACK, StepMonitor

    rates = {"host_adam_s_per_param": 2e-10, "host_adam_both_s_per_param": 3.5e-10}
    hardware = dataclasses.replace(hardware_profile(torch.device("cpu")), **rates)

    class Manager:  # (held weakly, as the model's ChunkManager; its worker thread's timings, runtime/chunks)
        host_updates = types.SimpleNamespace(timings=collections.deque([(100, 100 * 2.5e-10)] * 3))

    manager = Manager()
    monitor = StepMonitor(torch.device("cuda"), Plan(), None, manager=manager, hardware=hardware)
    with caplog.at_level("WARNING"):
        report = monitor._host_adam()
    assert report == {
        "measured_host_adam_s_per_param": pytest.approx(2.5e-10),
        "predicted_host_adam_s_per_param": None,  # (the plan has none)
        "profiled_host_adam_s_per_param": [2e-10, 3.5e-10],
    }
    assert not caplog.records
    manager.host_updates.timings.clear()
    manager.host_updates.timings.extend([(100, 100 * 3.5e-10 * HOST_RATE_SLACK * 2)] * 3)  # twice past the slack
    with caplog.at_level("WARNING"):
        monitor._host_adam()
    assert "measure it again: delete the cached profiles under" in caplog.text
