"""Training with parameters, gradients and optimizer states in chunks equals eager training.

Tolerance: bitwise. On CPU in fp32 the chunked model reads the same parameter values (views of a chunk
buffer), produces the same gradients, and the update is the same fused AdamW kernel, elementwise, on views
of the chunk; the eager reference uses `torch.optim.AdamW(fused=True)`. Across 2 ranks every rank gets the
same batch, so the averaged gradient (g + g) / 2 is exactly g.
"""

import copy

import models
import pytest
import torch
from helpers import ALL_OFFLOADED, bf16_chunks_against_autocast, train

import protrain_fx
from protrain_fx.distributed import rank_and_world_size
from protrain_fx.planner.cost import Candidate

STEPS = 10
PLANS = {
    "all-persistent": {},
    "all-offloaded": {"n_persist": 0, "n_buffer": 3},
    "in-between": {"n_persist": 2, "n_buffer": 2},
    # (one rank: its shard is the whole chunk, updated on the device, gathered into a buffer like an offloaded one)
    "sharded-on-the-device": {"n_persist": 1, "n_device_shard": 1, "n_buffer": 2},
}
# fewer host gradient shards than offloaded chunks, shared in turn (the plan for a host short of memory)
SHARED_GRADIENTS = {"n_persist": 0, "n_buffer": 3, "host_grad_slots": 1}


def run(kind, plan, steps=STEPS, exact=True, device="cpu", dtype=torch.float32, optimizers=None, **model_kw):
    """Train the same model eagerly and chunked under `plan`; (eager model, chunked model, backend). `optimizers`:
    a list that gets the two optimizers."""
    ref = models.build(kind, **model_kw).to(device, dtype)
    model = copy.deepcopy(ref)
    groups = lambda m: [  # noqa: E731 - no decay on biases and norms, as users do
        {"params": [p for n, p in m.named_parameters() if p.ndim > 1], "weight_decay": 0.1},
        {"params": [p for n, p in m.named_parameters() if p.ndim <= 1], "weight_decay": 0.0},
    ]
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(groups(model), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if optimizers is not None:
        optimizers += [ref_opt, opt]
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    ref_losses = train(ref, kind, steps, opt=ref_opt, device=device, after_step=lambda step: ref_sched.step())
    losses = train(compiled, kind, steps, opt=opt, device=device, after_step=lambda step: sched.step())
    if exact:
        assert losses == ref_losses
    else:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    return ref, model, backend


@pytest.mark.parametrize("plan", PLANS, ids=list(PLANS))
@pytest.mark.parametrize("kind", ["toy", "llama", "gpt2", "swin"])
def test_chunked_training_bitwise(kind, plan):
    ref, model, backend = run(kind, PLANS[plan])
    state = protrain_fx.full_state_dict(model)
    assert list(state) == list(ref.state_dict())
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name
    manager = protrain_fx.manager_of(model)
    assert manager is not None and manager.n_persist == backend.graphs[0].plan.n_persist
    assert all(p.grad is None for p in model.parameters())  # gradients live in the chunks


def test_blocks_with_a_graph_break_inside_are_each_compiled():
    """A graph break inside every block, in a loop over a slice of the blocks (Hugging Face's decoders loop so;
    Wav2Vec2's and M2M100's layers break on LayerDrop's data-dependent branch). Each block's frame is compiled
    and pinned to its modules, which Dynamo counts per module: no block is left to Python by its recompile limit
    (lowered here below the blocks). Dynamo gives the model's own frame up (it cannot resume inside the loop) and
    runs it as Python, which reads the model's own offloaded parameter (`pos`): it is lent from the second step on,
    as no graph reads it. Training is bitwise eager's."""
    layers = 3
    with torch._dynamo.config.patch(recompile_limit=2):
        _, model, backend = run("toy", ALL_OFFLOADED, steps=3, layers=layers, break_in_blocks=True)
    # (two graphs a block: before and after its graph break)
    assert len([g for g in backend.graphs if g.block_map and g.block_map.blocks_in_graph]) == 2 * layers
    manager = protrain_fx.manager_of(model)
    assert manager.outside.read_by_no_graph([manager.index[id(model.pos)]]) and not manager.is_persistent(model.pos)


@pytest.mark.parametrize(
    "device, plan",
    [*(("cpu", p) for p in PLANS), pytest.param("cuda", "all-persistent", marks=pytest.mark.gpu)],
)
def test_bfloat16_masters_train_as_torch_adamw_over_the_bfloat16_model(device, plan):
    """With the plan's master_dtype "bfloat16" a bfloat16 model keeps no fp32 master: its parameters, gradients
    and AdamW states are bfloat16 and train bitwise as torch's fused AdamW over the bfloat16 model (the same
    kernel on the same values; on CUDA the offloaded chunks' update runs on the host, so only persistent ones)."""
    plan, optimizers = {**PLANS[plan], "master_dtype": "bfloat16"}, []
    ref, model, backend = run("llama", plan, device=device, dtype=torch.bfloat16, optimizers=optimizers)
    manager = protrain_fx.manager_of(model)
    assert backend.graphs[0].plan.master_dtype == "bfloat16" and manager.master_dtype == torch.bfloat16
    assert all(manager.storage.master[c] is manager.storage.flat[c] for c in range(manager.n_persist))
    assert all(g.dtype == torch.bfloat16 for g in manager.storage.device_grads.owned)
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value.cpu()), name
    ref_states, states = (o.state_dict()["state"] for o in optimizers)
    assert sorted(states) == sorted(ref_states)
    for i, st in states.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].dtype == torch.bfloat16 and torch.equal(st[k], ref_states[i][k].cpu()), (i, k)


@pytest.mark.parametrize("master_dtype", ["float32", "bfloat16"])
def test_the_cost_model_counts_what_the_chunks_hold(master_dtype):
    """The planner's device and host bytes of a plan's model states (planner/memory_model.py `state_bytes`,
    `host_bytes`) are what the chunks and their AdamW states take once trained, for either master dtype (one
    offloaded chunk: one reduce buffer)."""
    plan, optimizers = {"n_persist": 1, "n_buffer": 2, "master_dtype": master_dtype}, []
    _, model, backend = run("llama", plan, steps=2, dtype=torch.bfloat16, optimizers=optimizers)
    manager, costs = protrain_fx.manager_of(model), backend.graphs[0].costs
    config = Candidate(manager.n_persist, manager.n_buffer)
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    states = chunk_states(manager, optimizers[1])
    assert costs.master_bytes == manager.master_bytes
    assert device_bytes_held(manager, states) == costs.state_bytes(config)
    offloaded = range(manager.n_persist, manager.layout.n_chunk)
    host = manager.storage.arena.numel() + sum(nbytes(states[c]) for c in offloaded)
    # (the model counts a shard's AdamW states over its padding too: one rank's shard of several ranks' may hold it)
    padding = sum(manager.layout.shard_elems - costs.chunk_params[c] for c in offloaded)
    assert host == costs.host_bytes(config) - padding * 2 * manager.master_bytes


def chunk_states(manager, optimizer) -> dict[int, list[torch.Tensor]]:
    """Each chunk's AdamW state tensors (the step counts left out)."""
    return {
        c: [t for st in optimizer.live_states(manager, c).values() for k, t in st.items() if k != "step"]
        for c in range(manager.layout.n_chunk)
    }


def device_bytes_held(manager, states) -> int:
    """The device bytes of the model states `manager` holds: its chunks, gradient, chunk and reduce buffers
    (with their shards across ranks), masters, the shards of the chunks sharded on the device (master and gradient),
    and the AdamW `states` (chunk -> tensors) of the chunks updated on the device."""
    storage = manager.storage
    on_device = range(manager.n_persist + manager.n_device_shard)
    device = [*storage.flat.values(), *storage.device_grads.owned, *manager.gathering.device_tensors()]
    device += [*manager.reduce_buffers.device_tensors(), *storage.shard_grads.owned]
    device += [storage.master[c] for c in on_device if storage.master.get(c) is not storage.flat.get(c)]
    return sum(t.numel() * t.element_size() for t in [*device, *(t for c in on_device for t in states[c])])


def test_offloaded_parameters_hold_no_storage_and_arena_is_exact():
    _, model, backend = run("llama", {"n_persist": 1, "n_buffer": 1}, steps=1)
    manager = protrain_fx.manager_of(model)
    plan = backend.graphs[0].plan
    assert plan.n_chunk == manager.layout.n_chunk and plan.chunk_bytes == manager.layout.chunk_bytes
    offloaded = [p for p in manager.params if not manager.is_persistent(p)]
    assert offloaded and all(p.untyped_storage().nbytes() == 0 for p in offloaded)
    # fp32 parameters (= master) and fp32 gradient: the gradient is copied straight into its shard
    per_chunk = manager.layout.shard_elems * (4 + 4)
    assert manager.storage.arena.numel() == per_chunk * (manager.layout.n_chunk - manager.n_persist)
    assert len(manager.gathering.buffers) == 1


def test_too_few_buffers_is_a_compile_time_error():
    with pytest.raises(Exception, match=r"n_buffer=1 chunk buffers, but the forward graph uses chunks \[\d+, \d+\] at"):
        run("gpt2", {"n_persist": 0, "n_buffer": 1}, steps=1)


def test_bad_chunk_plans():
    with pytest.raises(Exception, match=r"n_persist'\]=99 exceeds the model's"):
        run("toy", {"n_persist": 99}, steps=1)
    with pytest.raises(Exception, match="n_buffer'\\] must be at least 1"):
        run("toy", {"n_persist": 0, "n_buffer": 0}, steps=1)
    with pytest.raises(
        Exception, match=r"master_dtype'\] must be one of \['float32', 'bfloat16', 'float64'\], got 'float16'"
    ):
        run("toy", {"master_dtype": "float16"}, steps=1)
    with pytest.raises(Exception, match=r"master_dtype'\]='bfloat16' is for parameters of that dtype, and this"):
        run("toy", {"master_dtype": "bfloat16"}, steps=1)  # (a float32 model)
    with pytest.raises(Exception, match="master_dtype='bfloat16' does not suit this model, whose parameters are"):
        run("toy", {"master_dtype": "bfloat16"}, steps=1, dtype=torch.float16)  # (caught where the chunks are built)


def test_chunk_fields_need_the_protrain_optimizer():
    model = models.build("toy")
    compiled = torch.compile(
        model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": {"n_persist": 0}})
    )
    with pytest.raises(Exception, match="only when the model is trained with protrain_fx.optim.AdamW"):
        compiled(**models.batch("toy"))
    model = models.build("toy").to(torch.bfloat16)
    compiled = torch.compile(
        model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": {"master_dtype": "bfloat16"}})
    )
    with pytest.raises(Exception, match=r"asks for \{'master_dtype': 'bfloat16'\}, but parameters are managed"):
        compiled(**models.batch("toy"))


def test_optimizer_without_compile_equals_torch_adamw():
    ref = models.build("toy")
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(ref, "toy", 3, opt=ref_opt)
    train(model, "toy", 3, opt=opt)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    with pytest.raises(ValueError, match="betas in \\[0, 1\\)"):
        protrain_fx.optim.AdamW(model.parameters(), betas=(0.9, 1.5))


@pytest.mark.parametrize("n_persist, n_buffer", [(0, 3), (1, 3), (1, 1)])
def test_offloaded_parameters_read_through_inductor_are_exact(n_persist, n_buffer):
    """The first loss with offloaded chunks through inductor is plain inductor's, bitwise (CPU, fp32; inductor's
    CPU kernels, vectorized for the machine's instruction set, may round it an ulp from eager's). Inductor
    recomputes a pointwise reader of a parameter (the toy's `embed + pos`) inside later kernels unless it is
    materialized, and hoists gathers above releases unless they wait for release tokens: both read a buffer
    after the next chunk was loaded into it (losses 1.2e-2 and 2.5e-4 off before). One buffer: a gather loads
    into the buffer of the chunk before it, which it must not take as an input. Two blocks: eight chunks, the
    embedding alone in the first, more chunks than buffers."""
    ref = models.build("toy", layers=2)
    model = copy.deepcopy(ref)
    protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    plan = {"n_persist": n_persist, "n_buffer": n_buffer}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": plan}), dynamic=False)
    batch = models.batch("toy", seed=0)
    assert compiled(**batch).item() == torch.compile(ref, dynamic=False)(**batch).item()


def test_chunked_training_through_inductor():
    """The gather/release/reduce ops go through inductor as fallback kernels; fused kernels round differently
    from eager, so the same tolerance as the unchunked inductor test: losses 1e-4, parameters steps * lr. Two
    blocks (eight chunks, six offloaded through two buffers): inductor's compile time grows with the kernels."""
    ref = models.build("toy", layers=2)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": {"n_persist": 2, "n_buffer": 2}}))
    expected = train(ref, "toy", 3, opt=ref_opt)
    assert train(compiled, "toy", 3, opt=opt) == pytest.approx(expected, rel=1e-4)
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=3 * 1e-2)


def test_offloaded_chunks_share_the_host_gradient_shards_of_the_plan(monkeypatch):
    """host_grad_slots=1 for n offloaded chunks: training is bitwise eager's, and the arena holds one gradient
    shard besides the masters. The first step, whose host updates wait for optimizer.step(), holds every
    gradient: it takes plain host memory for the n - 1 shards it lacks and lets it go; later steps update during
    the backward and share the one. Every shard is given back after a step."""
    from protrain_fx import host

    asked = []
    check = host.check_host_memory
    monkeypatch.setattr(
        host, "check_host_memory", lambda needed, what, *a: (asked.append(what), check(needed, what, *a))
    )
    ref, model, _ = run("gpt2", SHARED_GRADIENTS, steps=4)
    state = protrain_fx.full_state_dict(model)
    assert all(torch.equal(state[name], value) for name, value in ref.state_dict().items())
    manager = protrain_fx.manager_of(model)
    manager.wait_for_update()
    n = manager.layout.n_chunk
    assert n > 1 and (manager.n_persist, manager.storage.grad_slots) == (0, 1)
    assert manager.storage.arena.numel() == manager.layout.shard_elems * 4 * (n + 1)
    assert sum("gradients" in what for what in asked) == n - 1, asked
    assert len(manager.storage.host_grads.free) == 1 and not manager.storage.grad


@pytest.mark.parametrize("plan", [PLANS["in-between"], SHARED_GRADIENTS], ids=["own-shards", "shared-shards"])
def test_zero_grad_after_the_step_leaves_the_host_updates_running(monkeypatch, plan):
    """`optimizer.zero_grad()` after the step returns while the offloaded chunks' host updates still run (each
    slowed here): the next forward waits for a chunk's update only as it gathers the chunk, so it starts beside
    them. Training stays bitwise eager's, with the host gradient shards each chunk's own or shared in turn."""
    import time

    from protrain_fx.host_queue import HostQueue

    submit = HostQueue.submit

    def slow_submit(self, chunk, copied, fn):
        return submit(self, chunk, copied, lambda: (time.sleep(0.02), fn()))

    monkeypatch.setattr(HostQueue, "submit", slow_submit)
    ref = models.build("gpt2")
    model = copy.deepcopy(ref)
    running = []

    def after_step(step):  # just after zero_grad: how many host updates of the step are still queued or running
        updates = protrain_fx.manager_of(model).host_updates
        running.append(sum(updates.pending(c) for c in updates.queued()))

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan}))
    assert train(compiled, "gpt2", 4, opt=opt, after_step=after_step) == train(ref, "gpt2", 4, opt=ref_opt)
    state = protrain_fx.full_state_dict(model)
    assert all(torch.equal(state[name], value) for name, value in ref.state_dict().items())
    assert max(running) > 0, running


# plan (gpt2), the error where the memory for a step's gradients is not there, and the one for a
# backward adding to the gradients of a step already taken
SHARING = {
    "host": (SHARED_GRADIENTS, ValueError, r"chunk \d+'s gradients need .* host memory .* shares 1 among the \d+ ", ""),
    "device": (
        {"device_grad_slots": 1},
        torch.OutOfMemoryError,
        r"chunk \d+'s gradients need a float32 gradient buffer .* shares 1 among the \d+ persistent chunks .* Train "
        r"without clipping or gradient accumulation",
        r"shares 1 gradient buffers among the persistent chunks .*",
    ),
}


def _no_room(m: pytest.MonkeyPatch, where: str, model) -> None:
    """No memory for another gradient shard on the host, or gradient buffer on the device."""
    if where == "host":
        from protrain_fx import host

        m.setattr(host, "available_host_bytes", lambda: 1000)
        return
    elems, empty = protrain_fx.manager_of(model).layout.chunk_elems, torch.empty

    def no_room(*size, **kwargs):
        if size == (elems,) and kwargs.get("dtype") is torch.float32:
            raise torch.OutOfMemoryError("out of memory")
        return empty(*size, **kwargs)

    m.setattr(torch, "empty", no_room)


@pytest.mark.parametrize("where", SHARING)
def test_shared_gradients_say_what_they_cannot_do(monkeypatch, where):
    """Offloaded chunks sharing one host gradient shard, or persistent ones one device gradient buffer: without
    memory for the gradients a step holds at once (a float32 model's first step waits for optimizer.step()),
    and a backward adding to the gradients of a step already taken (no zero_grad): errors that say what to do."""
    plan, error, no_room, taken = SHARING[where]
    for zero_grad in (True, False):
        model = models.build("gpt2")
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
        options = {"executor": "eager", "plan": plan}
        compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
        loss = models.loss_of("gpt2", compiled(**models.batch("gpt2")))  # (builds the chunks)
        if zero_grad:
            with monkeypatch.context() as m:
                _no_room(m, where, model)
                with pytest.raises(error, match=no_room):
                    loss.backward()
            continue
        loss.backward()
        opt.step()
        with pytest.raises(
            RuntimeError, match=taken + r"do not outlive optimizer.step\(\); call optimizer.zero_grad\(\)"
        ):
            models.loss_of("gpt2", compiled(**models.batch("gpt2"))).backward()


def test_host_memory_checked_before_allocating(monkeypatch):
    from protrain_fx import host

    monkeypatch.setattr(host, "available_host_bytes", lambda: 1000)
    with pytest.raises(Exception, match=r"need 0\.\d+ GiB of host memory .* but 0\.00 GiB is available"):
        run("toy", {"n_persist": 0, "n_buffer": 3}, steps=1)


@pytest.mark.parametrize("plan", [{}, {"n_persist": 1, "n_buffer": 3}], ids=["persistent", "offloaded"])
def test_optimizer_state_dict_matches_torch_and_resumes(plan):
    """state_dict() has torch AdamW's format and values; saving after 2 steps and loading into a new model and
    optimizer continues exactly like the uninterrupted run."""
    kind = "toy"
    ref = models.build(kind)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = {"executor": "eager", "plan": plan}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(backend), dynamic=False)
    train(ref, kind, 2, opt=ref_opt)
    train(compiled, kind, 2, opt=opt)
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for i, st in theirs["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours["state"][i][key], st[key]), (i, key)
        assert float(ours["state"][i]["step"]) == float(st["step"])
    assert ours["param_groups"][0]["lr"] == theirs["param_groups"][0]["lr"]

    weights = protrain_fx.full_state_dict(model)
    expected = train(compiled, kind, 2, opt=opt, first_step=2)  # the uninterrupted run

    resumed = models.build(kind, seed=123)
    resumed.load_state_dict(weights)
    resumed_opt = protrain_fx.optim.AdamW(resumed.parameters(), lr=5.0)  # lr comes back from the state
    resumed_opt.load_state_dict(ours)
    resumed_compiled = torch.compile(resumed, backend=protrain_fx.ProTrainBackend(backend), dynamic=False)
    assert train(resumed_compiled, kind, 2, opt=resumed_opt, first_step=2) == expected
    with pytest.raises(ValueError, match="param groups of sizes"):
        resumed_opt.load_state_dict({"state": {}, "param_groups": []})


@pytest.mark.parametrize("plan", [{}, {"n_persist": 0, "n_buffer": 3}], ids=["persistent", "offloaded"])
def test_parameter_no_graph_uses_is_not_updated(plan):
    """Like torch's AdamW, which skips a parameter whose .grad is None: weight decay must not touch it."""
    ref = models.build("toy")
    ref.blocks[1].unused = torch.nn.Parameter(torch.randn(16))
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan}))
    assert train(compiled, "toy", 3, opt=opt) == train(ref, "toy", 3, opt=ref_opt)
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("plan", [{}, {"n_persist": 1, "n_buffer": 2}], ids=["persistent", "offloaded"])
def test_fp32_chunks_under_autocast(plan):
    """Mixed precision by autocast in the user's loop: fp32 weights in chunks, bf16 compute; equal to eager
    training under the same autocast (the compiled graph runs the same casts and kernels)."""
    ref = models.build("llama")
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan}))
    expected = train(ref, "llama", 3, opt=ref_opt, autocast=torch.bfloat16)
    assert train(compiled, "llama", 3, opt=opt, autocast=torch.bfloat16) == expected
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("master", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_persistent_updates_during_the_backward_equal_updates_in_step(device, master):
    """From the second step on, a bf16 model's persistent chunks update as soon as their gradient is final (on
    CUDA on a stream beside the backward), and their parameters take the new fp32 master after the backward;
    with bf16 masters the parameters themselves change, after the backward's last read of them. Bitwise the
    same weights and states as updating everything in `step()`, which clipping forces (its max_norm here never
    scales a gradient), also where the two persistent chunks share one gradient buffer (`device_grad_slots`):
    taken in turn during the backward, and where every update waits for `step()`, one buffer more for the step
    alone. tests/test_chunk_distributed.py runs it on 2 ranks."""
    updates_during_the_backward_equal_updates_in_step(device, master)


def updates_during_the_backward_equal_updates_in_step(device: str = "cpu", master: str = "float32") -> None:
    def run(clip: bool, plan: dict):
        model = models.build("llama", seed=0).to(device, torch.bfloat16)
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        plan = {"n_persist": 2, "n_buffer": 2, "master_dtype": master, **plan}
        backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan})
        compiled = torch.compile(model, backend=backend, dynamic=False)
        started = []
        # (its own loop: it checks the chunks between the backward and opt.step(), and between step and zero_grad)
        for step in range(4):
            batch = {k: v.to(device) for k, v in models.batch("llama", seed=step).items()}
            models.loss_of("llama", compiled(**batch)).backward()
            manager = protrain_fx.manager_of(model)
            started.append(manager.updates_started())
            if clip:
                protrain_fx.clip_grad_norm_(model, 1e9)
            read_before_step = protrain_fx.full_state_dict(model)
            # a parameter that is its own master, read as it is (on CUDA: once the backward's end has waited for
            # the updates it started)
            read_directly = {n: p.detach().cpu() for n, p in model.named_parameters() if manager.is_persistent(p)}
            opt.step()
            # a shared buffer is free again (a step's own is let go), however the chunks were updated
            assert not manager.storage.shares_device_grads or len(manager.storage.device_grads.free) == 1
            opt.zero_grad()
        weights = protrain_fx.full_state_dict(model)
        if not clip and rank_and_world_size()[1] == 1:
            # every update started in the backward, so weights read before step() are the updated ones already
            assert all(torch.equal(read_before_step[k], v) for k, v in weights.items())
            if master == "bfloat16":
                assert read_directly and all(torch.equal(weights[k], v) for k, v in read_directly.items())
        return weights, opt.state_dict(), started

    weights, states, started = run(clip=False, plan={})
    # on several ranks the last all-reduce of the backward (chunk 0's) lands in step(), which updates it there
    early = {0, 1} if rank_and_world_size()[1] == 1 else {1}
    assert started[0] == [] and all(early <= set(s) for s in started[1:]), started
    for clip, plan in ((True, {}), (False, {"device_grad_slots": 1}), (True, {"device_grad_slots": 1})):
        weights_other, states_other, started_other = run(clip, plan)
        assert started_other == started if not clip else all(s == [] for s in started_other), started_other
        for name, value in weights_other.items():
            assert torch.equal(weights[name], value), (clip, plan, name)
        for i, st in states_other["state"].items():
            for k, v in st.items():
                assert torch.equal(states["state"][i][k], v), (clip, plan, i, k)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [{}, ALL_OFFLOADED, {"n_persist": 1, "n_buffer": 1}])
def test_chunked_bf16_parity(plan):
    """bf16 parameters in chunks with fp32 master weights (inductor) against eager fp32 training under bf16
    autocast with torch's fused AdamW: the bf16 tolerance on losses."""
    bf16_chunks_against_autocast({"plan": plan})


@pytest.mark.gpu
def test_shared_host_gradient_shards_train_as_one_each():
    """Offloaded chunks sharing one pinned host gradient shard (the first step, whose updates wait for
    optimizer.step(), takes plain host memory for the others) train bitwise as with a shard each."""
    base = models.big_llama(hidden=512, layers=4)
    ids = torch.randint(0, 32000, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = []
    for slots in ({}, {"host_grad_slots": 1}):
        model = copy.deepcopy(base)
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
        plan = {**ALL_OFFLOADED, **slots}
        compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": plan}), dynamic=False)
        losses = train(
            compiled, "llama", 4, opt=opt, device="cuda", batch=lambda step: {"input_ids": ids, "labels": ids}
        )
        manager = protrain_fx.manager_of(model)
        manager.wait_for_update()
        runs.append((losses, protrain_fx.full_state_dict(model), manager))
        torch._dynamo.reset()
    (losses, state, each), (shared_losses, shared_state, shared) = runs
    assert (each.storage.grad_slots, shared.storage.grad_slots) == (each.layout.n_chunk, 1) and each.layout.n_chunk >= 2
    assert shared.storage.arena.is_pinned() and len(shared.storage.host_grads.free) == 1
    assert shared_losses == losses
    assert all(torch.equal(shared_state[k], v) for k, v in state.items())


@pytest.mark.gpu
def test_chunk_buffers_allocated_once():
    """Offloaded chunks go through the same pre-allocated buffers every step: no growth, same addresses."""
    model = models.big_llama(hidden=1024, layers=8)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": {"n_persist": 2, "n_buffer": 2}}))
    ids = torch.randint(0, 32000, (4, 512), device="cuda")
    allocated = []

    def measure(step):
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())

    train(
        compiled,
        "llama",
        5,
        opt=opt,
        device="cuda",
        batch=lambda step: {"input_ids": ids, "labels": ids},
        after_step=measure,
    )
    manager = protrain_fx.manager_of(model)
    pointers = [b.data_ptr() for b in manager.gathering.buffers]
    compiled(input_ids=ids, labels=ids).loss.backward()
    assert [b.data_ptr() for b in manager.gathering.buffers] == pointers
    assert allocated[2] == allocated[3] == allocated[4], allocated
    assert manager.storage.arena.is_pinned()
    print(f"chunks {manager.layout.n_chunk} x {manager.layout.chunk_bytes / 2**20:.1f} MiB, allocated {allocated}")
