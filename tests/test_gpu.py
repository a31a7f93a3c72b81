"""GPU checks of the first stage: parity under bf16 autocast, and the profile against what the allocator and the
clock measure. Run on a GPU machine: `python -m pytest -m gpu tests/test_gpu.py`.

bf16 tolerance: autocast matmuls round to bf16 (eps 2^-8 = 0.0039); a loss is a mean over many such values,
so eager and compiled losses agree to a few eps: rtol 2e-2 over 5 steps. The eager executor must equal eager
PyTorch bitwise. Against plain `torch.compile` the inductor executor runs the same kernels, but some of them
(embedding backward) accumulate with atomics, which are not deterministic on a GPU: the same bf16 tolerance.
"""

from __future__ import annotations

import statistics

import models
import pytest
import torch
from helpers import eager_and_protrain, train

import protrain_fx
import protrain_fx.runtime.adopt
from protrain_fx.planner.cost import Candidate

pytestmark = pytest.mark.gpu
BF16_RTOL = 2e-2


@pytest.mark.parametrize("kind", models.MODEL_KINDS)
def test_inductor_bf16_parity(kind):
    (eager_losses, _), (losses, model), backend = eager_and_protrain(
        kind, steps=5, options={}, device="cuda", autocast=torch.bfloat16
    )
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=BF16_RTOL, atol=1e-3)
    plain = models.build(kind).cuda()
    plain_losses = train(torch.compile(plain, dynamic=False), kind, 5, device="cuda", autocast=torch.bfloat16)
    torch.testing.assert_close(torch.stack(losses), torch.stack(plain_losses), rtol=BF16_RTOL, atol=1e-3)
    profiled = [g for g in backend.graphs if g.profile is not None]  # graphs needing no grad have no backward
    assert profiled and all(g.profile.device.startswith("cuda") for g in profiled)


@pytest.mark.parametrize("kind", ["toy", "llama"])
def test_eager_executor_bf16_bitwise(kind):
    (eager_losses, ref), (losses, model), _ = eager_and_protrain(kind, steps=3, device="cuda", autocast=torch.bfloat16)
    assert [x.item() for x in losses] == [x.item() for x in eager_losses]


def _llama(hidden=2048, layers=16):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,  # 2048 -> 5632: the ~1B model of the benchmark
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        max_position_embeddings=1024,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)


UNCHANGED = {"plan": {"n_swap": 0, "n_checkpoint": 0}}  # the graphs run as profiled: no block swapped or recomputed


def measure_against_profile(executor: str, batch=8, seq=1024, steps=6, backend=None):
    """Returns (profiled s, measured s, profiled peak above start, measured peak above start) of forward+backward."""
    model = _llama()
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


def test_profile_matches_eager_execution():
    """The profile measures the graphs op by op, as the eager executor runs them: time within 10%, peak within 5%."""
    prof_s, meas_s, prof_peak, meas_peak = measure_against_profile("eager")
    print(
        f"eager executor: profiled {prof_s * 1e3:.1f} ms vs measured {meas_s * 1e3:.1f} ms; "
        f"peak {prof_peak / 2**30:.3f} vs {meas_peak / 2**30:.3f} GiB"
    )
    assert abs(prof_s - meas_s) <= 0.10 * meas_s
    assert abs(prof_peak - meas_peak) <= 0.05 * meas_peak


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


def test_fragmentation_is_the_profiled_iterations_own():
    """α (the profile's reserved over its allocated peak: the memory model's fragmentation factor) counts what the
    profiled iteration reserves, not blocks the allocator cached before it: here a freed 4 GiB tensor, more than
    the small model's whole step needs. Training's reserved bytes then stay near α times its allocated peak."""
    torch.cuda.empty_cache()
    cached = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    del cached  # (kept by the caching allocator)
    assert torch.cuda.memory_reserved() >= 4 * 2**30
    model = _llama(hidden=1024, layers=4)
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


@pytest.mark.parametrize("plan", [{}, {"n_persist": 0, "n_buffer": 2}, {"n_persist": 1, "n_buffer": 1}])
def test_chunked_bf16_parity(plan):
    """bf16 parameters in chunks with fp32 master weights (inductor) against eager fp32 training under bf16
    autocast with torch's fused AdamW: the same bf16 tolerance on losses."""
    import copy

    ref = models.build("llama", layers=4).cuda()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": plan}), dynamic=False)
    _train_against_autocast(ref, ref_opt, compiled, opt)


def test_shared_host_gradient_shards_train_as_one_each():
    """Offloaded chunks sharing one pinned host gradient shard (the first step, whose updates wait for
    optimizer.step(), takes plain host memory for the others) train bitwise as with a shard each."""
    import copy

    from protrain_fx.runtime.adopt import model_manager

    base = _llama(hidden=512, layers=4)
    ids = torch.randint(0, 32000, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = []
    for slots in ({}, {"host_grad_slots": 1}):
        model = copy.deepcopy(base)
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
        plan = {"n_persist": 0, "n_buffer": 2, **slots}
        compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": plan}), dynamic=False)
        losses = []
        for _ in range(4):
            losses.append(compiled(input_ids=ids, labels=ids).loss)
            losses[-1].backward()
            opt.step()
            opt.zero_grad()
        manager = model_manager(model)
        manager.wait_for_update()
        runs.append(([loss.item() for loss in losses], protrain_fx.full_state_dict(model), manager))
        torch._dynamo.reset()
    (losses, state, each), (shared_losses, shared_state, shared) = runs
    assert (each.grad_slots, shared.grad_slots) == (each.layout.n_chunk, 1) and each.layout.n_chunk >= 2
    assert shared.arena.is_pinned() and len(shared._free_grads) == 1
    assert shared_losses == losses
    assert all(torch.equal(shared_state[k], v) for k, v in state.items())


def test_chunk_buffers_allocated_once():
    """Offloaded chunks go through the same pre-allocated buffers every step: no growth, same addresses."""
    from protrain_fx.runtime.adopt import model_manager

    model = _llama(hidden=1024, layers=8)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": {"n_persist": 2, "n_buffer": 2}}))
    ids = torch.randint(0, 32000, (4, 512), device="cuda")
    allocated = []
    for _ in range(5):
        compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    manager = model_manager(model)
    pointers = [b.data_ptr() for b in manager.buffers]
    compiled(input_ids=ids, labels=ids).loss.backward()
    assert [b.data_ptr() for b in manager.buffers] == pointers
    assert allocated[2] == allocated[3] == allocated[4], allocated
    assert manager.arena.is_pinned()
    print(f"chunks {manager.layout.n_chunk} x {manager.layout.chunk_bytes / 2**20:.1f} MiB, allocated {allocated}")


def test_spinning_openmp_threads_are_warned_of(monkeypatch, caplog):
    """OpenMP threads that spin when idle slow the offloaded chunks' host AdamW about threefold: a plan that
    offloads chunks says so."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    model = _llama(hidden=1024, layers=8)
    protrain_fx.optim.AdamW(model.parameters(), lr=1e-4)  # (chunks are made for this optimizer)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": {"n_persist": 2, "n_buffer": 2}}))
    ids = torch.randint(0, 32000, (2, 64), device="cuda")
    with caplog.at_level("WARNING", logger="protrain_fx.runtime.chunks"):
        compiled(input_ids=ids, labels=ids).loss.backward()
    assert any("OMP_WAIT_POLICY=ACTIVE" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("plan", [{"n_persist": 1, "n_buffer": 2}, None])
def test_prepared_cpu_model_trains_on_gpu(plan):
    """A bf16 model built on the CPU, put into chunks on the GPU by `prepare` (most chunks in the host arena, or,
    with no plan, every chunk until the first compile's search places them): its losses follow eager fp32
    training under autocast within the bf16 tolerance, and the GPU never held the offloaded parameters."""
    import copy

    ref = models.build("llama", layers=4)
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref = ref.cuda()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    largest = max(p.numel() * 2 for p in model.parameters())
    protrain_fx.prepare(model, plan=plan)
    assert all(p.is_cuda for p in model.parameters())
    manager = protrain_fx.runtime.adopt.model_manager(model)
    # prepare allocates on the GPU one persistent chunk (bf16, fp32 master, fp32 gradient), two bf16 buffers (with
    # no plan: no persistent chunk, one buffer), the fp32 landing area of a loaded shard, and one parameter in
    # passing (+ the allocator's 512-byte rounding)
    per_elem = (2 + 4 + 4 + 2 + 2 + 4) if plan else (2 + 4)
    assert torch.cuda.max_memory_allocated() - before <= manager.layout.chunk_elems * per_elem + largest + 8 * 512
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="protrain", dynamic=False)
    _train_against_autocast(ref, ref_opt, compiled, opt)
    assert manager.pending_plan is None and manager.n_persist == protrain_fx.plan_of(model).n_persist


def test_fp16_chunks_with_loss_scaling():
    """float16 weights in chunks (one on the GPU, the rest offloaded) with protrain_fx.amp.GradScaler, against
    eager fp32 training under float16 autocast with torch.amp.GradScaler: the same tolerance as bf16."""
    import copy

    ref = models.build("llama", layers=4).cuda()
    model = copy.deepcopy(ref).half()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    ref_scaler = torch.amp.GradScaler("cuda")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = protrain_fx.amp.GradScaler()
    options = {"plan": {"n_persist": 1, "n_buffer": 2}}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    for step in range(5):
        batch = {k: v.cuda() for k, v in models.batch("llama", seed=step).items()}
        with torch.autocast("cuda", dtype=torch.float16):
            ref_loss = ref(**batch).loss
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        loss = compiled(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=BF16_RTOL), f"step {step}"


@pytest.mark.parametrize("plan", [{"n_checkpoint": 2}, {"block_modes": ["checkpoint", "none", "checkpoint", "none"]}])
def test_checkpointed_bf16_parity(plan):
    """Checkpointed blocks through inductor on the GPU, bf16 autocast, dropout on: the bf16 tolerance."""
    (eager_losses, _), (losses, _), backend = eager_and_protrain(
        "llama", steps=5, options={"plan": plan}, device="cuda", autocast=torch.bfloat16, layers=4, dropout=0.1
    )
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=BF16_RTOL, atol=1e-3)
    assert backend.graphs[0].plan.n_checkpoint == 2


@pytest.mark.parametrize(
    "plan",
    [
        {"n_selective": 4},
        {"block_modes": ["selective", "checkpoint", "selective", "none"]},
        {"block_modes": ["swap", "selective", "selective", "none"], "swap_interval": 1},
    ],
)
def test_selective_bf16_parity(plan):
    """Selective blocks (beside checkpointed and swapped ones) through inductor on the GPU, bf16 autocast, dropout
    on: the bf16 tolerance; the matmuls (the test models' eager attention's too) are kept, not recomputed."""
    (eager_losses, _), (losses, _), backend = eager_and_protrain(
        "llama", steps=5, options={"plan": plan}, device="cuda", autocast=torch.bfloat16, layers=4, dropout=0.1
    )
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=BF16_RTOL, atol=1e-3)
    record = backend.graphs[0]
    assert record.plan.n_selective == record.plan.block_modes.count("selective") > 0
    matmuls = [
        n for n in record.profile.nodes if n.graph == "forward" and n.target in ("aten.mm.default", "aten.bmm.default")
    ]
    assert matmuls and all(not n.recomputed for n in matmuls)


@pytest.mark.parametrize(
    "plan",
    [
        {"n_persist": 0, "n_buffer": 2, "n_selective": 4},
        {"n_persist": 1, "n_buffer": 3, "block_modes": ["selective", "checkpoint", "selective", "none"]},
    ],
)
def test_selective_with_offloaded_chunks_bf16_parity(plan):
    """Selective blocks over offloaded chunks (inductor, fp32 masters) against eager fp32 training under bf16
    autocast: the bf16 tolerance on losses."""
    import copy

    ref = models.build("llama", layers=4).cuda()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": plan}), dynamic=False)
    _train_against_autocast(ref, ref_opt, compiled, opt)


def test_recomputed_attention_keeps_its_layout_rule(monkeypatch):
    """A checkpointed block's fused attention is a random op (for its dropout, even at 0), so AOTAutograd wraps
    its recompute in `graphsafe_run_with_rng_state`, which inductor lowers without the attention's stride rule;
    the backend's lowering of the wrapper restores it (runtime/ops.py `_dense_recomputed_attention`: cuDNN failed
    on a query strided in its head dimension, training the 5.5B on four ranks). The recomputed attention is
    lowered through it, and training keeps the bf16 tolerance."""
    import copy

    from torch._inductor.lowering import lowerings
    from torch._prims.rng_prims import graphsafe_run_with_rng_state

    from protrain_fx.runtime.ops import register_inductor_lowering

    register_inductor_lowering()
    ours, wrapped = lowerings[graphsafe_run_with_rng_state], []
    assert ours.protrain_dense_attention

    def spy(op, *args, **kwargs):
        wrapped.append(op._opname)
        return ours(op, *args, **kwargs)

    monkeypatch.setitem(lowerings, graphsafe_run_with_rng_state, spy)
    ref = models.build("llama", layers=4).cuda()
    ref.config._attn_implementation = "sdpa"  # (the test models' own is the eager attention: no fused op)
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"plan": {"n_checkpoint": 2}}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    _train_against_autocast(ref, ref_opt, compiled, opt, steps=3)
    assert any(name.startswith("_scaled_dot_product") for name in wrapped), wrapped


def _train_against_autocast(ref, ref_opt, compiled, opt, steps: int = 5) -> None:
    """Eager fp32 `ref` under bf16 autocast and the bf16 `compiled` model side by side: losses within BF16_RTOL."""
    for step in range(steps):
        batch = {k: v.cuda() for k, v in models.batch("llama", seed=step).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_loss = ref(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = compiled(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=BF16_RTOL), f"step {step}"


@pytest.mark.parametrize("plan", [{"n_swap": 2}, {"n_swap": 1, "n_checkpoint": 2}])
def test_swapped_bf16_parity(plan):
    """Swapped blocks through inductor on the GPU (copies on their own streams, pinned host slots), bf16
    autocast, dropout on: the bf16 tolerance."""
    (eager_losses, _), (losses, _), backend = eager_and_protrain(
        "llama", steps=5, options={"plan": plan}, device="cuda", autocast=torch.bfloat16, layers=4, dropout=0.1
    )
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=BF16_RTOL, atol=1e-3)
    record = backend.graphs[0]
    assert record.swap is not None and record.swap.arena.is_pinned()


@pytest.mark.parametrize("room", [True, False], ids=["prefetched", "deferred"])
def test_swap_next_to_offloaded_chunks(room, monkeypatch):
    """Swapped blocks with offloaded chunks: swap prefetches queue behind the chunk uploads on the copy link; with
    no memory budget left, every block comes back at its first use instead. bf16 chunks against eager autocast."""
    import copy

    if not room:
        make = protrain_fx.backend.SwapSpace
        monkeypatch.setattr(
            protrain_fx.backend, "SwapSpace", lambda device, **kw: make(device, **{**kw, "budget_bytes": 1})
        )
    ref = models.build("llama", layers=4).cuda()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"plan": {"n_persist": 1, "n_buffer": 3, "n_swap": 2, "n_checkpoint": 1, "n_selective": 0}}
    backend = protrain_fx.ProTrainBackend(options)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    _train_against_autocast(ref, ref_opt, compiled, opt)
    space = backend.graphs[0].swap
    assert space._uploads is not None
    if not room:  # (with room, how many prefetch depends on the predicted peak, the budget)
        assert space.deferred > 0


def test_swapped_activations_are_not_overwritten_while_copied():
    """Activations large enough that their copies to the host outlast the kernels after them (32 MiB each: batch 8,
    sequence 1024, hidden 1024, float32): inductor must not hand a swapped tensor's memory to a later kernel while
    its copy may still read it. The gradients of the all-swapped plan equal those of the plan without swapping up
    to fusion differences (1.5e-6 of the norm on an H200; in bfloat16 both are 1.4% from a float32 reference, too
    coarse to see a tensor overwritten in part)."""
    import copy

    model = _llama(hidden=1024, layers=4).float()
    ids = torch.randint(0, 32000, (8, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    grads = {}
    for name, plan in (("plain", UNCHANGED["plan"]), ("swapped", {"n_swap": 4, "n_checkpoint": 0})):
        m = copy.deepcopy(model)
        backend = protrain_fx.ProTrainBackend({"plan": plan})
        compiled = torch.compile(m, backend=backend, dynamic=False)
        for _ in range(2):  # the second step runs as compiled, with no profile in between
            m.zero_grad(set_to_none=True)
            compiled(input_ids=ids, labels=ids).loss.backward()
        grads[name] = [p.grad.float() for p in m.parameters()]
        assert (backend.graphs[0].swap is not None) == (name == "swapped")
    for (name, _), a, b in zip(model.named_parameters(), grads["plain"], grads["swapped"]):
        assert (b - a).norm() <= 1e-4 * a.norm(), name


def test_hardware_profile_on_gpu(tmp_path):
    """Pinned copies in both directions, the fused AdamW on the GPU and the CPU, the GPU's AdamW beside matmuls
    (partly hidden, and slower than alone), the card's memory from NVML."""
    from protrain_fx.profiler.hardware import hardware_profile

    profile = hardware_profile(torch.device("cuda"), cache_dir=tmp_path)
    print(profile)
    assert profile.h2d_bytes_per_s > 5e9 and profile.d2h_bytes_per_s > 5e9
    assert profile.device_adam_s_per_param < profile.host_adam_s_per_param
    assert profile.host_adam_both_s_per_param > profile.host_adam_s_per_param  # copies share the host's memory
    assert profile.both_beside_host_bytes_per_s < profile.h2d_bytes_per_s  # and the AdamW slows the copies
    assert 0 < profile.device_adam_hidden_beside_matmul < 1 and profile.device_adam_stretch_beside_matmul > 1
    # matmuls measured at four shares of the device's time, never faster than in a burst
    points = profile.matmul_stretch_sustained
    assert len(points) == 4 and all(0 < share <= 1 and stretch >= 1 for share, stretch in points)
    # NVML's total counts memory the driver keeps for itself, which cudaMemGetInfo's total leaves out
    assert profile.device_memory_bytes == pytest.approx(torch.cuda.mem_get_info()[1], rel=0.02)


def test_profile_on_demand_matches_the_full_profile(monkeypatch):
    """The 1B model at batch 8 profiled twice: holding everything, and with saved activations and gradients
    dropped while unused (profiler/on_demand.py). Node memory figures agree up to the allocator's 512-byte
    rounding of each dropped tensor, the graphs' time within 5%, and the GPU in fact held far less."""
    from protrain_fx import backend as backend_module
    from protrain_fx.profiler.on_demand import OnDemand

    profiles = []
    original = backend_module.profile_iteration

    def both(fw, bw, primals, block_map, on_demand=None):
        profiles.append(original(fw, bw, primals, block_map, OnDemand()))
        profiles.append(original(fw, bw, primals, block_map))
        return profiles[-1]

    monkeypatch.setattr(backend_module, "profile_iteration", both)
    model = _llama()
    protrain_fx.optim.AdamW(model.parameters())
    backend = protrain_fx.ProTrainBackend({"executor": "inductor", **UNCHANGED})
    ids = torch.randint(0, 32000, (8, 1024), device="cuda")
    torch.compile(model, backend=backend, dynamic=False)(input_ids=ids, labels=ids).loss.backward()
    dropped, full = profiles
    worst = max(
        abs((a.allocated_before - dropped.baseline_bytes) - (b.allocated_before - full.baseline_bytes))
        for a, b in zip(dropped.nodes, full.nodes)
    )
    print(
        f"on demand: peak {dropped.peak_bytes / 2**30:.3f} GiB (held {dropped.measured_peak_bytes / 2**30:.3f}), "
        f"full: {full.peak_bytes / 2**30:.3f} GiB; worst node difference {worst / 2**20:.2f} MiB; time "
        f"{dropped.iteration_s * 1e3:.1f} vs {full.iteration_s * 1e3:.1f} ms"
    )
    assert [n.name for n in dropped.nodes] == [n.name for n in full.nodes]
    assert worst <= 4 * 2**20
    assert abs(dropped.peak_bytes - full.peak_bytes) <= 0.01 * full.peak_bytes
    assert dropped.saved_bytes == full.saved_bytes
    assert abs(dropped.iteration_s - full.iteration_s) <= 0.05 * full.iteration_s
    assert dropped.measured_peak_bytes < 0.5 * full.peak_bytes


@pytest.mark.parametrize("plan", [{"n_persist": 0, "n_buffer": 2}, None])
def test_prepared_model_profiled_and_trained_under_a_memory_limit(plan):
    """A prepared 1B model at batch 8 under a 12 GiB limit on this process: profiling it whole would need about
    twice that (its profile says so), on demand it fits; the searched plan then trains within the limit (with no
    plan given to prepare, the search also places the chunks)."""
    limit = 12 * 2**30
    model = _llama().cpu()
    protrain_fx.prepare(model, plan=plan)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-4)
    backend = protrain_fx.ProTrainBackend({"gpu_memory_bytes": limit})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    ids = torch.randint(0, 32000, (8, 1024), device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    try:
        torch.cuda.reset_peak_memory_stats()
        losses = []
        for _ in range(3):
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        peak = torch.cuda.max_memory_allocated()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    profile, plan = backend.graphs[0].profile, backend.graphs[0].plan
    print(
        f"profile peak {profile.peak_bytes / 2**30:.2f} GiB, held {profile.measured_peak_bytes / 2**30:.2f} GiB; "
        f"plan {plan.block_modes}, predicted peak {plan.predicted_peak_bytes / 2**30:.2f} GiB, measured "
        f"{peak / 2**30:.2f} GiB; losses {losses}"
    )
    assert profile.peak_bytes > limit > profile.measured_peak_bytes
    assert peak <= limit and all(torch.isfinite(torch.tensor(losses)))
    assert protrain_fx.runtime.adopt.model_manager(model).n_persist == plan.n_persist < plan.n_chunk
