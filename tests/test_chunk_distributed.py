"""Chunked training across ranks (gloo, spawned processes): every rank ends with eager training's parameters.

Each rank trains on the same batches. With 2 ranks the averaged gradient (g + g) / 2 equals g exactly, so the
result must be bitwise equal to single-process eager training with `torch.optim.AdamW(fused=True)`. With 3,
(g + g + g) / 3 rounds: losses agree to 1e-5, parameters to steps * lr (AdamW normalizes each update to about
lr, so a rounding difference in a near-zero gradient can move a parameter by that much).
"""

import os

import pytest
import torch
import torch.distributed as dist
from helpers import OFFLOADED
from spawn import gloo_rank, join, run_rank, spawn, spawn_gloo

from protrain_fx.config import MIN_MEMORY_BYTES
from protrain_fx.distributed import most_on_every_rank


def _train_like_eager(rank: int, world: int, kind: str, plan: dict, backend: str, device: str) -> None:
    from test_chunk_parity import chunk_states, device_bytes_held, run

    import protrain_fx
    from protrain_fx.planner.cost import Candidate

    # a power of two averages without rounding; on GPUs the eager reference steps with CUDA's fused AdamW and
    # the offloaded chunks with the CPU's, whose roundings differ by an ulp
    exact = world & (world - 1) == 0 and backend == "gloo"
    dtype = getattr(torch, plan.get("master_dtype", "float32"))  # (bfloat16 masters: a bfloat16 model)
    optimizers = []
    ref, model, compiler = run(kind, plan, steps=4, exact=exact, device=device, dtype=dtype, optimizers=optimizers)
    # the device holds what the planner counts, across ranks each reduce buffer's shard too
    manager, costs = protrain_fx.manager_of(model), compiler.graphs[0].costs
    held = device_bytes_held(manager, chunk_states(manager, optimizers[1]))
    # (the AdamW states of a chunk sharded on the device are those of this rank's shard: counted for the rank holding
    # the most)
    held = int(max(most_on_every_rank([float(held)], torch.device(device))))
    config = Candidate(manager.n_persist, manager.n_buffer, n_device_shard=manager.n_device_shard)
    assert held == costs.state_bytes(config), f"rank {rank}: {held} bytes"
    state = protrain_fx.full_state_dict(model)  # a collective: every rank calls it
    for name, value in ref.state_dict().items():
        value = value.cpu()
        if exact:
            assert torch.equal(state[name], value), f"rank {rank}: {name} differs"
        else:
            torch.testing.assert_close(state[name], value, rtol=0, atol=4 * 1e-2)


def _worker(rank: int, world: int, rendezvous: str, cases: list, errors, backend: str = "gloo"):
    """Each (kind, plan) of `cases` in turn on the same ranks (one spawn, one process group: starting the ranks
    costs more than a case), as a fresh compile (Dynamo reset, as between tests)."""
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"

    def body():
        for case in cases:
            torch._dynamo.reset()
            try:
                _train_like_eager(rank, world, *case, backend, device)
            except BaseException as e:
                e.add_note(f"(case {case})")
                raise

    run_rank(backend, rank, world, rendezvous, errors, body)


# chunks sharded across the ranks on the device (ZeRO-3 there), mixed with persistent and offloaded ones, and alone
DEVICE_SHARDED = [
    ("toy", {"n_persist": 2, "n_device_shard": 5, "n_buffer": 3, "host_grad_slots": 2}),
    ("llama", {"n_persist": 0, "n_device_shard": 2, "n_buffer": 2}),
]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_train_like_eager(world):
    """Each case on the same `world` ranks, one after the other (one spawn)."""
    cases = [
        # (the toy's 11 offloaded chunks share 2 host gradient shards: runtime/chunks/slots.py)
        ("toy", {"n_persist": 0, "n_buffer": 3, "host_grad_slots": 2}),
        ("llama", {"n_persist": 1, "n_buffer": 1}),
        *DEVICE_SHARDED,
    ]
    spawn(_worker, world, cases)


def test_four_ranks_with_chunks_sharded_on_the_device_train_like_eager():
    spawn(_worker, 4, DEVICE_SHARDED[:1])


def test_ranks_train_bfloat16_masters_like_eager():
    """bfloat16 masters (the plan's master_dtype): gradients reduced in bfloat16, persistent and offloaded chunks
    bitwise as torch's fused AdamW over the bfloat16 model."""
    spawn(_worker, 2, [("llama", {"n_persist": 1, "n_buffer": 1, "master_dtype": "bfloat16"})])


def _meta_worker(rank, world, rendezvous, host_bytes, errors):
    join("gloo", rank, world, rendezvous)
    monkeypatch = pytest.MonkeyPatch()
    try:
        import copy

        import models
        from cost_models import TWO_RANKS
        from helpers import train

        import protrain_fx
        from protrain_fx.backend import planning

        # the ranks plan for a machine where offloading a chunk costs more than keeping it, so that with memory to
        # spare every chunk stays persistent (on the CPU's measured profile the two are near, and the noise in its
        # collectives decides)
        monkeypatch.setattr(planning, "hardware_profile", lambda device: TWO_RANKS)
        ref = models.build("toy")
        values = {name: t.detach().clone() for name, t in ref.state_dict().items()}
        ample = protrain_fx.explain(copy.deepcopy(ref), models.batch("toy"), {"executor": "eager"})
        assert ample.n_persist == ample.n_chunk, ample
        with torch.device("meta"):
            model = models.ToyTransformer()
        prefix = {id(m): name for name, m in model.named_modules()}

        def init(module):
            for name, p in module.named_parameters(recurse=False):
                p.copy_(values[f"{prefix[id(module)]}.{name}".lstrip(".")])

        protrain_fx.prepare(model, device="cpu", init=init)
        manager = protrain_fx.manager_of(model)
        shard = manager.layout.shard_elems  # each rank holds its own shard of every master, not the model
        assert manager.pending_plan == {} and all(m.numel() == shard for m in manager.storage.master.values())
        options = {"executor": "eager", "gpu_memory_bytes": int(ample.predicted_reserved_bytes * 0.8)}
        if host_bytes is not None:
            options["host_memory_bytes"] = host_bytes
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        assert train(compiled, "toy", 4, opt=opt) == train(ref, "toy", 4, opt=ref_opt), f"rank {rank}"
        plan = protrain_fx.plan_of(model)
        assert plan.n_persist < plan.n_chunk and manager.n_persist == plan.n_persist, plan
        if host_bytes is not None:  # (the GPUs together hold what the host cannot: sharded there)
            assert plan.n_device_shard > 0 and manager.n_device_shard == plan.n_device_shard, plan
        state = protrain_fx.full_state_dict(model)  # a collective: every rank calls it
        copied = copy.deepcopy(model).state_dict()  # (so is a deep copy, where chunks are sharded)
        for name, value in ref.state_dict().items():
            assert torch.equal(state[name], value), f"rank {rank}: {name} differs"
            assert torch.equal(copied[name], value), f"rank {rank}: {name} of the deep copy differs"
    except BaseException as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


@pytest.mark.parametrize("host_bytes", [None, MIN_MEMORY_BYTES], ids=["host", "no-host"])
def test_meta_model_prepared_without_a_plan_across_ranks(host_bytes):
    """A meta-device model prepared with no plan on 2 ranks: each rank fills only its own master shards, the ranks
    search one plan at the first compile (every chunk persistent with memory to spare, some not under the smaller
    GPU: sharded on the GPUs where the host has no room), and train bitwise like eager; a deep copy holds the same
    values."""
    spawn(_meta_worker, 2, host_bytes)


@pytest.mark.multigpu
@pytest.mark.parametrize("plan", [{"n_persist": 0, "n_buffer": 3}, {"n_persist": 1, "n_buffer": 2}])
def test_nccl_ranks_train_like_eager(plan):
    """Two GPUs, NCCL all-gather and reduce-scatter, fp32: losses to 1e-5 and parameters to steps * lr, as with
    3 gloo ranks (the reference's CUDA AdamW and the offloaded chunks' CPU AdamW round differently)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(_nccl_worker, 2, "toy", plan, cuda=True)


def _nccl_worker(rank, world, rendezvous, kind, plan, errors):
    _worker(rank, world, rendezvous, [(kind, plan)], errors, backend="nccl")


def _disagreeing_worker(rank: int, world: int, rendezvous: str, how: str, errors):
    def body():
        import models

        import protrain_fx
        import protrain_fx.backend.stages

        plan = {"n_persist": 1 + rank, "n_buffer": 2} if how == "plan" else {}
        model = models.build("toy", layers=3 + rank if how == "model" else 3)
        opt = protrain_fx.optim.AdamW(model.parameters())  # noqa: F841
        if how == "profiling" and rank == 1:

            def broken(*args, **kwargs):
                raise MemoryError("no memory to profile in")

            protrain_fx.backend.stages.profile_iteration = broken
        expected = {
            "plan": r"ranks \[1\] disagree with rank 0 on the model or plan",
            "model": r"ranks compiled different graphs",
            "profiling": r"profiling failed on rank 1: MemoryError: no memory to profile in",
        }[how]
        backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan})
        compiled = torch.compile(model, backend=backend)
        with pytest.raises(Exception, match=expected):
            compiled(**models.batch("toy"))

    gloo_rank(rank, world, rendezvous, errors, body)


@pytest.mark.parametrize("how", ["plan", "model", "profiling"])
def test_ranks_that_disagree_or_fail_fail_together(how):
    """A plan or graph that differs between ranks, or profiling that fails on one: every rank raises the same
    error, none waits in a collective."""
    spawn(_disagreeing_worker, 2, how)


def _state_dict_worker(rank: int, world: int, rendezvous: str, errors):
    from test_chunk_parity import test_optimizer_state_dict_matches_torch_and_resumes

    gloo_rank(rank, world, rendezvous, errors, lambda: test_optimizer_state_dict_matches_torch_and_resumes(OFFLOADED))


def test_optimizer_state_dict_across_ranks():
    """The single-process state_dict test on 2 ranks: AdamW.state_dict() gathers the sharded states (every rank
    gets torch's AdamW state, bitwise), and loading it resumes exactly."""
    spawn(_state_dict_worker, 2)


def _early_updates_worker(rank: int, world: int, rendezvous: str, errors):
    from test_chunk_parity import updates_during_the_backward_equal_updates_in_step

    gloo_rank(
        rank, world, rendezvous, errors, lambda: updates_during_the_backward_equal_updates_in_step("cpu", "bfloat16")
    )


def test_persistent_updates_during_the_backward_across_ranks():
    """Persistent chunks' updates start as their all-reduce lands (during the backward), offloaded shards' as
    their reduce-scatter does: the same weights and states as deferring every update to `step()`, with bf16
    masters (the parameters themselves, updated in place; fp32 masters are tested on one rank in
    test_chunk_parity.py, and train across ranks like eager in test_ranks_train_like_eager)."""
    spawn(_early_updates_worker, 2)


def _dying_rank(rank: int, world: int) -> None:
    """Rank 1 dies before its third step; rank 0 fails at its next collective with an error that says so."""
    import time

    import models

    import protrain_fx

    model = models.build("toy")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": OFFLOADED}))
    for step in range(4):  # (its own loop: a rank dies in it)
        if step == 2 and rank == 1:
            os._exit(0)
        start = time.perf_counter()
        try:
            compiled(**models.batch("toy", seed=step)).backward()
            opt.step()
        except RuntimeError as e:
            assert step == 2 and "Another rank has most likely died or stopped" in str(e), (step, e)
            assert time.perf_counter() - start < 60
            return
        opt.zero_grad()
    raise AssertionError("rank 0 trained on without rank 1")


def test_a_dead_rank_stops_the_others_with_a_clear_error():
    spawn_gloo(_dying_rank, 2)


def _out_of_memory_on_one_rank(rank: int, world: int) -> None:
    """Rank 1 runs out of memory in a forward under on_oom="replan": it cannot re-plan alone (rank 0 is inside the
    step's collectives), so it raises, saying so; rank 0 stops at its next collective with the dead-rank error."""
    import models
    from test_oom import FAIL_AT, Inject

    import protrain_fx

    inject = Inject(pytest.MonkeyPatch(), "gather")
    model = models.build("toy")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"executor": "eager", "plan": OFFLOADED, "on_oom": "replan"}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options))
    for step in range(FAIL_AT + 2):  # (its own loop: a step runs out of memory in it)
        inject.armed = step == FAIL_AT and rank == 1
        try:
            compiled(**models.batch("toy", seed=step)).backward()
            opt.step()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            expected = "re-plans a single process only (this is rank 1 of 2" if rank == 1 else "most likely died"
            assert step == FAIL_AT and expected in str(e), (rank, step, e)
            return
        opt.zero_grad()
    raise AssertionError(f"rank {rank} trained on")


def test_out_of_memory_on_one_of_several_ranks_stops_them_all():
    spawn_gloo(_out_of_memory_on_one_rank, 2)
