"""The profiling interpreter and the CPU memory tracker; on a GPU, the profile against what the allocator and the
clock measure."""

import json
import statistics

import models
import pytest
import torch
from helpers import UNCHANGED
from torch import fx

import protrain_fx
from protrain_fx.capture import FrameRoots, build_block_map
from protrain_fx.planner.cost import Candidate
from protrain_fx.profiler.interpreter import ProfilingInterpreter
from protrain_fx.profiler.memory import CpuMemoryTracker
from protrain_fx.profiler.profile import GraphProfile
from protrain_fx.profiler.timed import TimedGraph


def test_cpu_tracker_hand_built_sequence():
    n = 1000  # fp32: 4000 bytes a tensor
    with CpuMemoryTracker() as tracker:
        a = torch.ones(n)  # 4000
        b = a * 2  # 8000
        v = b.view(10, 100)  # a view: no new storage
        del a  # 4000
        c = torch.cat([b, b])  # 4000 + 8000 = 12000 (peak)
        del b  # v still holds b's storage: 12000
        del v  # 8000
        assert tracker.allocated() == 8000
        assert tracker.peak() == 12000
        tracker.reset_peak()
        d = c.sum()  # 8000 + 4
        del c, d
        assert tracker.allocated() == 0
        assert tracker.peak() == 8004


def test_interpreter_intra_and_inter_deltas():
    def f(x):
        y = x * 2  # 4000 new
        z = torch.cat([y, y])  # 8000 new, y freed after
        return z.sum()

    gm = fx.symbolic_trace(f)
    block_map = build_block_map(gm, FrameRoots())
    with CpuMemoryTracker() as tracker:
        x = torch.ones(1000)
        tracker.track([x])
        interp = ProfilingInterpreter(gm, tracker=tracker, graph_kind="forward", block_map=block_map)
        interp.run(x)
    mul, cat, total = interp.records
    assert (mul.allocated_before, mul.intra_delta_bytes, mul.output_bytes) == (4000, 4000, 4000)
    assert (cat.allocated_before, cat.intra_delta_bytes, cat.output_bytes) == (8000, 8000, 8000)
    # y is freed between cat and sum: sum starts from x + z
    assert total.allocated_before == 12000 and total.inter_delta_bytes == 0
    assert interp.peak_bytes == 16000  # x + y + z while cat runs
    timing = TimedGraph(gm, graph_kind="forward", block_map=block_map, device=torch.device("cpu"))
    assert timing.boxed_run([torch.ones(1000)]) == 2 * 2 * 1000
    assert [r.name for r in timing.records] == ["mul", "cat", "sum_1"]
    assert all(r.latency_s > 0 for r in timing.records)


def _saved_bytes_by_hooks(kind, layers):
    """Activation bytes autograd keeps for backward, seen by saved-tensor hooks (parameters and inputs excluded)."""
    model = models.build(kind, layers=layers)
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    batch = models.batch(kind)
    compiled(**batch)
    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *batch.values()]}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in known:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(**batch)
    return sum(seen.values()), backend.graphs


@pytest.mark.parametrize("kind", ["toy", "llama"])
def test_block_saved_bytes_equal_what_forward_saves(kind):
    measured, graphs = _saved_bytes_by_hooks(kind, layers=3)
    profile = graphs[0].profile
    assert profile.saved_bytes == measured
    per_block = [b.saved_bytes for b in profile.blocks]
    assert len(per_block) == 3
    # one block more adds exactly one block's saved bytes
    fewer, _ = _saved_bytes_by_hooks(kind, layers=2)
    assert per_block[1] == per_block[2] == measured - fewer
    assert per_block[0] > 0
    # node-level records add up to the block totals
    for b in profile.blocks:
        assert b.saved_bytes == sum(n.saved_bytes for n in profile.nodes if n.block == b.block and n.graph == "forward")
        assert b.forward_s > 0 and b.backward_s > 0


def test_profile_roundtrips_json_and_csv():
    _, graphs = _saved_bytes_by_hooks("toy", layers=2)
    profile = graphs[0].profile
    again = GraphProfile.from_json(json.loads(json.dumps(profile.to_json())))
    assert again == profile
    lines = profile.to_csv().splitlines()
    assert lines[0].startswith("name,target,graph,region,block,latency_s")
    assert len(lines) == len(profile.nodes) + 1
    assert profile.peak_bytes >= profile.baseline_bytes + profile.saved_bytes
    record = graphs[0]
    for gm in (record.forward, record.backward):
        for node in gm.graph.nodes:
            if node.op == "call_function" and not str(node.target).startswith("protrain."):  # (passes' ops)
                assert node.meta["protrain"] is profile.node(node.name, node.meta["protrain"].graph)


def test_profiling_leaves_rng_untouched():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    model = models.build("toy", dropout=0.5)
    torch.set_rng_state(before)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}), dynamic=False)
    batch = models.batch("toy")
    state = torch.get_rng_state()
    compiled(**batch)  # compiles and profiles, then runs the step once
    after_compiled = torch.get_rng_state()
    torch.set_rng_state(state)
    model(**batch)
    assert torch.equal(after_compiled, torch.get_rng_state())


def _captured_llama():
    """A 2-layer LLaMA trained one step with the eager executor: (its backend, its graph's record)."""
    from helpers import CapturingBackend

    backend = CapturingBackend({"executor": "eager"})
    compiled = torch.compile(models.build("llama", layers=2), backend=backend, dynamic=False)
    models.loss_of("llama", compiled(**models.batch("llama"))).backward()
    return backend, backend.graphs[0]


def test_backward_holds_the_output_gradients_where_the_engine_does(monkeypatch):
    """Where the autograd engine keeps the backward's output gradients until it returns (torch without boxed
    gradients), the profile holds them too: the tiny LLaMA's logits gradient stays counted to the end."""
    from protrain_fx.profiler import interpreter

    backend, record = _captured_llama()
    tangents = [n for n in record.backward.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    held_bytes = sum(n.meta["val"].nbytes for n in tangents)
    assert held_bytes >= 2 * 16 * 96 * 4  # the logits' gradient: batch, sequence, vocabulary, fp32

    def backward_records(frees):
        monkeypatch.setattr(interpreter, "ENGINE_FREES_OUTPUT_GRADS", frees)
        profile = interpreter.profile_iteration(record.forward, record.backward, backend.inputs, record.block_map)
        return [r for r in profile.nodes if r.graph == "backward"]

    held, freed = backward_records(False), backward_records(True)
    readers = {u.name for n in tangents for u in n.users}
    last = max(i for i, r in enumerate(freed) if r.name in readers)
    extra = {h.allocated_before - f.allocated_before for h, f in zip(held[last + 1 :], freed[last + 1 :])}
    assert extra == {held_bytes}, extra


def test_each_node_keeps_its_least_time_over_the_timed_runs(monkeypatch):
    """Something else running during one timed iteration only adds time: each node keeps its least time over
    TIMED_RUNS iterations, so one slowed iteration leaves no trace (and with one timed run, it would)."""
    from protrain_fx.profiler import interpreter

    backend, record = _captured_llama()
    iteration, timed_calls = interpreter._iteration, []

    def one_slow_timed_run(*args):
        nodes, *rest = iteration(*args)
        if args[5] is None:  # no tracker: a timed iteration
            timed_calls.append(len(timed_calls))
            if len(timed_calls) == slow_run:
                for r in nodes:
                    r.latency_s += 1.0
        return (nodes, *rest)

    monkeypatch.setattr(interpreter, "_iteration", one_slow_timed_run)
    for runs, slow_run, slowed in ((1, 1, True), (interpreter.TIMED_RUNS, 2, False)):
        monkeypatch.setattr(interpreter, "TIMED_RUNS", runs)
        timed_calls.clear()
        profile = interpreter.profile_iteration(record.forward, record.backward, backend.inputs, record.block_map)
        assert len(timed_calls) == runs
        assert all((n.latency_s >= 1.0) == slowed for n in profile.nodes), (runs, slow_run)


def test_cpu_timed_runs_use_one_thread_and_give_the_others_back(monkeypatch):
    """On the CPU the timed iterations run with one intra-op thread (an op split over threads waits for the last
    of them, which on a loaded machine waits for a core), the memory run and everything after with as many as
    before; the profile keeps how far its timed runs spread (`timing_noise`)."""
    from protrain_fx.profiler import interpreter

    backend, record = _captured_llama()
    iteration, threads = interpreter._iteration, []

    def counting(*args):
        threads.append(("timed" if args[5] is None else "memory", torch.get_num_threads()))
        return iteration(*args)

    monkeypatch.setattr(interpreter, "_iteration", counting)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        profile = interpreter.profile_iteration(record.forward, record.backward, backend.inputs, record.block_map)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert threads == [("memory", 2)] + [("timed", 1)] * interpreter.TIMED_RUNS and after == 2
    assert profile.timing_noise >= 0 and all(n.latency_s >= 0 for n in profile.nodes)


def test_clock_probes_run_between_timed_nodes_and_stay_out_of_their_times(monkeypatch):
    """On CUDA a probe matmul runs every PROBE_EVERY timed nodes, between marks of its own (here a CPU stand-in
    that sleeps 50 ms); each node's probe time is interpolated between the probes around it."""
    import time

    from protrain_fx.profiler import timed

    def f(x):
        return ((x * 2 + 1) * 3 - 1).sum()

    gm = fx.symbolic_trace(f)
    monkeypatch.setattr(timed, "PROBE_EVERY", 2)
    timing = TimedGraph(
        gm, graph_kind="forward", block_map=build_block_map(gm, FrameRoots()), device=torch.device("cpu"),
        probe=lambda: time.sleep(0.05),
    )  # fmt: skip
    assert timing.boxed_run([torch.ones(10)]) == 80
    assert [at for at, _ in timing.probe_s] == [0, 2, 4] and len(timing.records) == 5
    assert all(t >= 0.05 for _, t in timing.probe_s)
    assert all(r.latency_s < 0.05 for r in timing.records)
    timing.probe_s = [(0, 1.0), (2, 3.0), (4, 4.0)]
    assert timing.probe_at_records() == [1.0, 2.0, 3.0, 3.5, 4.0]


def test_matmuls_keep_their_least_time_at_burst_clocks():
    """A matmul's time in each timed run is taken at the clocks of the fastest probe of all runs (times that
    probe's time over the probe time where it ran), then the least over the runs; other nodes, bound by memory,
    keep their least time as run. The timing noise is how far the runs' median times sum above the least."""
    from protrain_fx.profiler.interpreter import least_at_burst_clocks
    from protrain_fx.profiler.profile import NodeProfile

    def nodes():
        return [NodeProfile(n, t, "forward", "block", 0, 0.0, 0, 0, 0, 0) for n, t in (("mm", "aten.mm.default"),
                ("add", "aten.add.Tensor"))]  # fmt: skip

    latencies = [[1.2, 0.5], [1.1, 0.6]]
    timed = nodes()
    # the first run's probes ran 1.2 times as long as the second's: its clocks were lower
    stretch, noise = least_at_burst_clocks(timed, latencies, [[1.2, 1.2], [1.0, 1.0]])
    assert stretch == pytest.approx(1.1) and noise == pytest.approx((1.05 + 0.55) / (1.0 + 0.5) - 1)
    assert [n.latency_s for n in timed] == pytest.approx([1.0, 0.5])
    plain = nodes()  # no probes (the CPU): each node's least time as run
    stretch, noise = least_at_burst_clocks(plain, latencies, [])
    assert stretch == 1.0 and noise == pytest.approx((1.15 + 0.55) / (1.1 + 0.5) - 1)
    assert [n.latency_s for n in plain] == [1.1, 0.5]


def measure_against_profile(executor: str, batch=8, seq=1024, steps=6, backend=None):
    """Returns (profiled s, measured s, profiled peak above start, measured peak above start) of forward+backward."""
    model = models.big_llama()
    backend = backend or protrain_fx.ProTrainBackend({"executor": executor, **UNCHANGED})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")
    times, peaks = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        compiled(input_ids=ids, labels=ids).loss.backward()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) / 1e3)
        peaks.append(torch.cuda.max_memory_allocated() - start_bytes)
    profiles = [g.profile for g in backend.graphs if g.profile]
    profiled_s = sum(p.iteration_s for p in profiles)
    profiled_peak = max(p.peak_bytes - p.baseline_bytes for p in profiles)
    return profiled_s, statistics.median(times[2:]), profiled_peak, max(peaks[2:])


@pytest.mark.gpu
def test_profile_matches_eager_execution():
    """The profile measures the graphs op by op, as the eager executor runs them: time within 10%, peak within 5%."""
    prof_s, meas_s, prof_peak, meas_peak = measure_against_profile("eager")
    print(
        f"eager executor: profiled {prof_s * 1e3:.1f} ms vs measured {meas_s * 1e3:.1f} ms; "
        f"peak {prof_peak / 2**30:.3f} vs {meas_peak / 2**30:.3f} GiB"
    )
    assert abs(prof_s - meas_s) <= 0.10 * meas_s
    assert abs(prof_peak - meas_peak) <= 0.05 * meas_peak


@pytest.mark.gpu
def test_profile_against_inductor_execution():
    """Inductor fuses ops, so it runs faster and with fewer transients than the op-by-op profile. The cost model's
    fused estimate of the compute (planner/cost.py: node_s) must be within 10% of inductor's measured time, and the
    profile must never under-predict the compiled peak."""
    backend = protrain_fx.ProTrainBackend({"executor": "inductor", **UNCHANGED})
    prof_s, meas_s, prof_peak, meas_peak = measure_against_profile("inductor", backend=backend)
    terms = [g.costs.phases(Candidate()) for g in backend.graphs if g.costs is not None]
    fused_s = sum(t["forward_s"] + t["backward_s"] for t in terms)
    print(
        f"inductor executor: profiled {prof_s * 1e3:.1f} ms, fused estimate {fused_s * 1e3:.1f} ms, measured "
        f"{meas_s * 1e3:.1f} ms; peak {prof_peak / 2**30:.3f} vs {meas_peak / 2**30:.3f} GiB"
    )
    assert abs(fused_s - meas_s) <= 0.10 * meas_s
    assert prof_peak >= 0.98 * meas_peak
    # the matmuls' times are those at the clocks of the fastest probe (profiler/interpreter.py)
    assert all(g.profile.matmul_clock_stretch >= 1 for g in backend.graphs if g.profile is not None)


@pytest.mark.gpu
def test_fragmentation_is_the_profiled_iterations_own():
    """α (the profile's reserved over its allocated peak: the memory model's fragmentation factor) counts what the
    profiled iteration reserves, not blocks the allocator cached before it: here a freed 4 GiB tensor, more than
    the small model's whole step needs. Training's reserved bytes then stay near α times its allocated peak."""
    model = models.big_llama(hidden=1024, layers=4)  # (built first: its weights would take the cached block)
    torch.cuda.empty_cache()
    cached = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    del cached  # (kept by the caching allocator)
    assert torch.cuda.memory_reserved() >= 4 * 2**30
    backend = protrain_fx.ProTrainBackend({"executor": "inductor", **UNCHANGED})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    ids = torch.randint(0, 32000, (4, 512), device="cuda")
    for step in range(3):
        compiled(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        if step == 0:  # compiled and profiled; the steps after are training's
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    profile = backend.graphs[0].profile
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    print(f"alpha {profile.fragmentation:.3f}; training reserved {reserved / peak:.3f} times its peak")
    assert profile.measured_peak_bytes < 2 * 2**30  # (counted, the cached 4 GiB would make α over 2)
    assert 1 <= profile.fragmentation < 1.5
    assert reserved <= 1.1 * profile.fragmentation * peak
