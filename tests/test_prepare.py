"""protrain_fx.prepare (chunks built before compiling, from a CPU or meta-device model) and the chunk runtime's
guards: a chunk that gets gradients from several graphs, a second backward, replaced parameters.

Tolerance: bitwise, as in test_chunk_parity (fp32 on the CPU, the same fused AdamW kernel on views).
"""

import copy
import gc
import os
import re

import models
import pytest
import torch
from helpers import train, train_against_autocast

import protrain_fx

OFFLOADED = {"n_persist": 0, "n_buffer": 2}


def _compare(ref, model, kind, steps=4, options=None):
    """Train `ref` eagerly and the prepared `model` through the backend; both must end bitwise equal."""
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", **(options or {})})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    assert train(compiled, kind, steps, opt=opt) == train(ref, kind, steps, opt=ref_opt)
    state = protrain_fx.full_state_dict(model)
    assert list(state) == list(ref.state_dict())
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name
    return backend


@pytest.mark.parametrize("kind", ["toy", "llama"])
def test_prepared_cpu_model_trains_like_eager(kind):
    ref = models.build(kind)
    model = protrain_fx.prepare(copy.deepcopy(ref), plan={"n_persist": 1, "n_buffer": 2}, device="cpu")
    manager = protrain_fx.manager_of(model)
    assert manager.n_persist == 1 and manager.layout.n_chunk > 1
    offloaded = [p for p in manager.params if not manager.is_persistent(p)]
    assert offloaded and all(p.untyped_storage().nbytes() == 0 for p in offloaded)
    backend = _compare(ref, model, kind)
    assert backend.graphs[0].plan.n_persist == 1  # the plan in force is the prepared one


def test_meta_model_with_init_trains_like_the_cpu_model():
    ref = models.build("toy")
    values = {name: t.detach().clone() for name, t in ref.state_dict().items()}
    with torch.device("meta"):
        model = models.ToyTransformer()
    prefix = {id(m): name for name, m in model.named_modules()}
    initialised = []

    def init(module):
        initialised.append(prefix[id(module)])
        for name, p in module.named_parameters(recurse=False):
            p.copy_(values[f"{prefix[id(module)]}.{name}".lstrip(".")])

    protrain_fx.prepare(model, plan=OFFLOADED, device="cpu", init=init)
    assert not any(t.is_meta for t in model.parameters())
    assert len(initialised) == len(set(initialised))  # each module once
    _compare(ref, model, "toy")


def _plan_trained(model, options, steps=1, kind="llama"):
    """The plan of `model` trained `steps` steps through the backend with protrain's AdamW."""
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    compiled = torch.compile(
        model, backend=protrain_fx.ProTrainBackend({"executor": "eager", **options}), dynamic=False
    )
    train(compiled, kind, steps, opt=opt)
    return protrain_fx.plan_of(model)


@pytest.fixture(scope="module")
def on_device():
    """The plan of the llama test model compiled on the device (no prepare, no plan fields), compiled once in the
    module: its tests only read it."""
    return _plan_trained(models.build("llama"), {})


def test_prepare_without_a_plan_is_planned_by_the_search(on_device):
    """No plan fields: the chunks wait offloaded until the first compile's search places them. With room for
    every chunk the plan is the one a model on the device gets; under a smaller GPU the search offloads, and
    training stays bitwise eager's."""
    ref = models.build("llama")
    prepared = protrain_fx.prepare(copy.deepcopy(ref), device="cpu")
    manager = protrain_fx.manager_of(prepared)
    assert manager.pending_plan == {} and manager.n_persist == 0
    searched = _plan_trained(prepared, {})
    fields = ("n_persist", "n_buffer", "n_chunk", "block_modes", "host_grad_slots", "device_grad_slots")
    assert {k: getattr(searched, k) for k in fields} == {k: getattr(on_device, k) for k in fields}
    assert manager.pending_plan is None and manager.n_persist == searched.n_persist
    assert on_device.n_persist == on_device.n_chunk  # (so that a smaller GPU below must offload)

    small = {"gpu_memory_bytes": int(on_device.predicted_reserved_bytes * 0.8)}
    model = protrain_fx.prepare(copy.deepcopy(ref), device="cpu")
    backend = _compare(ref, model, "llama", steps=5, options=small)
    plan = backend.graphs[0].plan
    assert plan.n_persist < plan.n_chunk and protrain_fx.manager_of(model).n_persist == plan.n_persist
    assert plan.predicted_reserved_bytes <= small["gpu_memory_bytes"]


def test_placing_counts_the_host_masters_it_frees(monkeypatch):
    """The first plan puts half of the chunks on the device: `place` frees their host masters before AdamW makes
    the offloaded chunks' states, so a host with room for what training holds once placed is enough, though it
    could not hold those states beside every master prepare filled (a 14B model on 125 GiB was refused so)."""
    import weakref

    import protrain_fx.host

    ref = models.build("llama")
    model = protrain_fx.prepare(copy.deepcopy(ref), device="cpu", plan={"chunk_bytes": 16896})  # (7 chunks)
    manager = protrain_fx.manager_of(model)
    n_chunk, shard = manager.layout.n_chunk, manager.layout.shard_elems * 4
    persist, offloaded = n_chunk // 2, n_chunk - n_chunk // 2
    assert persist >= 3 and manager.pending_plan is not None
    prepared = [weakref.ref(m) for m in manager.storage.master.values()]
    # the simulated host: room for the offloaded masters, their AdamW states and a gradient shard each, less the
    # masters prepare filled while they live
    room = shard * offloaded * 4 + shard // 2
    monkeypatch.setattr(
        protrain_fx.host,
        "available_host_bytes",
        lambda: room - sum(m().untyped_storage().nbytes() for m in prepared if m() is not None),
    )
    fields = {"n_persist": persist, "n_buffer": 1, "host_grad_slots": offloaded}
    _compare(ref, model, "llama", steps=3, options={"plan": fields})
    assert manager.n_persist == persist and sum(m() is not None for m in prepared) == offloaded


def test_a_failed_first_compile_leaves_the_prepared_chunks_waiting(monkeypatch):
    """Profiling runs out of memory (raised here on the CPU): the error reaches the user, the chunks stay as
    prepare left them (offloaded, waiting for a plan), and compiling again trains bitwise like eager."""
    import protrain_fx.backend.stages as stages_module

    ref = models.build("llama")
    model = protrain_fx.prepare(copy.deepcopy(ref), device="cpu")
    real = stages_module.profile_iteration

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("profiling ran out of memory (raised by the test)")

    monkeypatch.setattr(stages_module, "profile_iteration", out_of_memory)
    failed = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}), dynamic=False)
    with pytest.raises(Exception, match="raised by the test"):
        failed(**models.batch("llama"))
    manager = protrain_fx.manager_of(model)
    assert manager.pending_plan == {} and manager.n_persist == 0 and manager.step_grads.idle()
    monkeypatch.setattr(stages_module, "profile_iteration", real)
    torch._dynamo.reset()
    _compare(ref, model, "llama")


def test_chunks_that_fit_nowhere_are_told_before_the_profile(monkeypatch):
    """No placement of a waiting model's chunks fits even with no activations (too little GPU; or too little host
    for what the GPU cannot keep): NoPlanFits at the first compile, before the graph is profiled on demand (which
    takes minutes for the largest models). The chunks stay waiting, and with room the model trains like eager."""
    import protrain_fx.backend.stages as stages_module

    ref = models.build("llama")
    model = protrain_fx.prepare(copy.deepcopy(ref), device="cpu")
    manager = protrain_fx.manager_of(model)
    real, profiled = stages_module.profile_iteration, []
    monkeypatch.setattr(stages_module, "profile_iteration", lambda *a, **k: profiled.append(1) or real(*a, **k))
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    too_small = {
        "no plan fits the GPU: ": {"gpu_memory_bytes": 2**16},
        "no plan fits the host memory: ": {"gpu_memory_bytes": 3 * param_bytes, "host_memory_bytes": 2**16},
    }
    for head, options in too_small.items():
        failed = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", **options}))
        with pytest.raises(Exception, match=head) as raised:
            failed(**models.batch("llama"))
        assert "even with no activations" in str(raised.value.inner_exception)
        assert not profiled and manager.pending_plan == {}
        torch._dynamo.reset()
    _compare(ref, model, "llama", options={"gpu_memory_bytes": 20 * param_bytes})
    assert profiled


def test_deepcopy_of_a_chunked_model_is_the_eager_models_copy():
    """copy.deepcopy of a trained chunked model (offloaded chunks) or of one of its modules, as a reference model
    is made: plain parameters holding the current values, none of protrain's hooks or state, a forward equal to the
    eager model's; the model itself goes on training bitwise like eager, its hooks as they were."""
    ref = models.build("llama")
    model = protrain_fx.prepare(copy.deepcopy(ref), plan={"n_persist": 1, "n_buffer": 2}, device="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}), dynamic=False)
    assert train(compiled, "llama", 2, opt=opt) == train(ref, "llama", 2, opt=ref_opt)
    hooks = {m: (dict(m._forward_pre_hooks), dict(m._state_dict_hooks)) for m in model.modules()}
    manager = protrain_fx.manager_of(model)
    # (else the default deepcopy would clone an offloaded parameter's absent storage: a crash, not a failure)
    assert all("__deepcopy__" in m.__dict__ for m in model.modules() if any(map(manager.holds, m._parameters.values())))

    copied = copy.deepcopy(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(copied.state_dict()[name], value), name
    assert protrain_fx.manager_of(copied) is None and "_ddp_params_and_buffers_to_ignore" not in copied.__dict__
    for m in copied.modules():
        assert not [k for k in m.__dict__ if k.startswith("_protrain") or k in ("_apply", "__deepcopy__")]
        assert not m._forward_pre_hooks and not m._state_dict_hooks
        assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in m.parameters())
    batch = models.batch("llama", seed=7)
    with torch.no_grad():
        assert torch.equal(copied(**batch).logits, ref(**batch).logits)
    layer = model.model.layers[1]
    assert all(torch.equal(a, b) for a, b in zip(copy.deepcopy(layer).parameters(), ref.model.layers[1].parameters()))

    assert {m: (dict(m._forward_pre_hooks), dict(m._state_dict_hooks)) for m in model.modules()} == hooks
    losses = train(compiled, "llama", 2, opt=opt, first_step=2)
    assert losses == train(ref, "llama", 2, opt=ref_opt, first_step=2)


def test_no_plan_fits_names_the_fields_forced_and_the_n_persist_that_fits(on_device):
    """Every chunk kept persistent by prepare's plan, under a GPU too small for that: the error names n_persist as
    forced by the chunks already built, and the n_persist the search finds instead, which then trains under that
    GPU and is what prepare without a plan gets. The same n_persist in options['plan'] is named as the user's."""
    ref = models.build("llama")
    n_chunk, small = on_device.n_chunk, {"gpu_memory_bytes": int(on_device.predicted_reserved_bytes * 0.8)}
    model = protrain_fx.prepare(copy.deepcopy(ref), plan={"n_persist": n_chunk}, device="cpu")
    with pytest.raises(Exception, match="no plan fits the GPU") as raised:
        _plan_trained(model, small)
    error = raised.value.inner_exception  # (torch.compile wraps the backend's NoPlanFits)
    message = str(error)
    built = "forced by the chunks already built (by protrain_fx.prepare or an earlier graph)"
    assert f"with n_persist={n_chunk}, host_grad_slots=0, device_grad_slots={n_chunk} {built}" in message
    n_persist = error.released.config.n_persist
    assert n_persist < n_chunk and f"searched instead, the search plans n_persist={n_persist} " in message
    model = protrain_fx.prepare(copy.deepcopy(ref), plan={"n_persist": n_persist}, device="cpu")
    plan = _plan_trained(model, small)
    assert plan.n_persist == n_persist and plan.predicted_reserved_bytes <= small["gpu_memory_bytes"]
    assert _plan_trained(protrain_fx.prepare(copy.deepcopy(ref), device="cpu"), small).n_persist == n_persist
    with pytest.raises(Exception, match=re.escape(f"with n_persist={n_chunk} forced by options['plan']")):
        _plan_trained(copy.deepcopy(ref), {**small, "plan": {"n_persist": n_chunk}})


def test_prepare_holds_the_fields_it_is_given_and_the_compile_holds_the_rest():
    model = protrain_fx.prepare(models.build("llama"), plan={"n_buffer": 2}, device="cpu")
    plan = _plan_trained(model, {"plan": {"n_persist": 0}})
    assert (plan.n_persist, plan.n_buffer) == (0, 2)
    model = protrain_fx.prepare(models.build("llama"), plan={"n_buffer": 2}, device="cpu")
    compiled = torch.compile(
        model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": {"n_buffer": 1}}), dynamic=False
    )
    with pytest.raises(Exception, match="asks for n_buffer=1 but the model's chunks were already built .* n_buffer=2"):
        compiled(**models.batch("llama"))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_pretrained_weights_from_safetensors_shards(kind, tmp_path):
    """save_pretrained in shards, an empty model (parameters on the meta device, buffers real, as accelerate's
    init_empty_weights(include_buffers=False) builds it), prepare(weights=folder): every value equals the saved
    model's (a tied head found under its embedding's name), and training is bitwise eager's."""
    from accelerate import init_empty_weights

    ref = models.build(kind)
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    with init_empty_weights(include_buffers=False):
        model = type(ref)(ref.config)
    model.tie_weights()  # (init_empty_weights unties them, as accelerate documents)
    protrain_fx.prepare(model, weights=tmp_path, device="cpu")
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name
    _compare(ref, model, kind)


PEAK_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM
import protrain_fx

def rss_peak():
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM")).split()[1])

config = AutoConfig.from_pretrained(sys.argv[1])
with init_empty_weights(include_buffers=False):
    model = AutoModelForCausalLM.from_config(config)
Path("/proc/self/clear_refs").write_text("5")  # (the peak so far: from here)
before = rss_peak()
protrain_fx.prepare(model, weights=sys.argv[1], device="cpu")
manager = protrain_fx.manager_of(model)
chunks = sum(m.untyped_storage().nbytes() for m in manager.storage.master.values()) + manager.storage.arena.numel()
print(json.dumps({"grew": (rss_peak() - before) * 1024, "chunks": chunks}))
"""


def test_pretrained_weights_peak_host_memory(tmp_path):
    """prepare(weights=...) of an empty model: the host's peak grows by what the chunks hold (fp32 masters, every
    chunk offloaded until the first compile) and a few tensors in passing, not by the checkpoint too."""
    import json
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs /proc/self/clear_refs")
    config = LlamaConfig(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=12, num_attention_heads=8, vocab_size=2048
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="40MB")
    # glibc's dynamic mmap threshold keeps tensors the size of this small model's, once freed, resident in its
    # heap (a large model's are mapped and given back): a fixed threshold measures what prepare holds
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    checkpoint = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert measured["grew"] < measured["chunks"] + 0.25 * checkpoint, (measured, checkpoint)


def test_pretrained_weights_errors(tmp_path):
    """Where the checkpoint is not found; and for a module that is not a Hugging Face model (filled by its tensors'
    names: tests/test_pretrained_loading.py has transformers' rules), tensors it lacks, checked before anything is
    built."""
    from safetensors.torch import save_model

    models.build("llama").save_pretrained(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor model.safetensors"):
        protrain_fx.prepare(models.build("llama"), weights=tmp_path / "empty", device="cpu")
    with pytest.raises(ValueError, match="pass a folder saved by save_pretrained"):
        protrain_fx.prepare(models.build("llama"), weights=tmp_path / "missing", device="cpu")
    ref = models.build("toy")
    save_model(ref, tmp_path / "toy.safetensors")  # (the tied head once, under the embedding's name)
    with torch.device("meta"):
        model = models.ToyTransformer()
    protrain_fx.prepare(model, weights=tmp_path / "toy.safetensors", device="cpu")
    state = protrain_fx.full_state_dict(model)
    assert all(torch.equal(state[name], value) for name, value in ref.state_dict().items())
    with torch.device("meta"):
        meta = models.ToyTransformer(layers=4)
    with pytest.raises(ValueError, match="on the meta device and the checkpoint has no values for them .* init=fn"):
        protrain_fx.prepare(meta, weights=tmp_path / "toy.safetensors", device="cpu")
    other = models.build("toy", layers=4)
    with pytest.raises(ValueError, match="the checkpoint has no values for 12 parameters"):
        protrain_fx.prepare(other, weights=tmp_path / "toy.safetensors", device="cpu")
    assert protrain_fx.manager_of(other) is None  # (checked before anything is built)


def test_prepare_errors():
    with torch.device("meta"):
        meta = models.ToyTransformer()
    with pytest.raises(ValueError, match="on the meta device .* pass init=fn"):
        protrain_fx.prepare(meta, device="cpu")
    model = protrain_fx.prepare(models.build("toy"), plan=OFFLOADED, device="cpu")
    with pytest.raises(ValueError, match="in chunks already"):
        protrain_fx.prepare(model, device="cpu")
    with pytest.raises(TypeError, match="takes an nn.Module"):
        protrain_fx.prepare("model")
    frozen = models.build("toy").requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        protrain_fx.prepare(frozen, device="cpu")
    protrain_fx.optim.AdamW(model.parameters())
    compiled = torch.compile(
        model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": {"n_persist": 1}})
    )
    with pytest.raises(
        Exception, match="asks for n_persist=1 but the model's chunks were already built .* n_persist=0"
    ):
        compiled(**models.batch("toy"))


def test_chunk_with_gradients_from_two_graphs():
    """A graph break inside the one chunk: both graphs' backwards reduce into it, and it steps once, after the
    second (the first backward to run, of the later graph, must not step it alone)."""
    ref = models.build("toy", graph_break_after=0)
    model = copy.deepcopy(ref)
    options = {"plan": {"n_persist": 0, "n_buffer": 1, "chunk_bytes": 2**20}}
    backend = _compare(ref, model, "toy", options=options)
    with_params = [g for g in backend.graphs if g.param_map]
    assert len(with_params) == 2 and protrain_fx.manager_of(model).layout.n_chunk == 1


def test_parameter_replaced_after_compile_is_an_error():
    model = models.build("toy")
    protrain_fx.optim.AdamW(model.parameters())
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": OFFLOADED}))
    compiled(**models.batch("toy")).backward()
    model.blocks[0].proj.weight = torch.nn.Parameter(torch.randn(32, 32))
    with pytest.raises(Exception, match="'blocks.0.proj.weight' was created or replaced after the model's chunks"):
        compiled(**models.batch("toy"))


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [{"n_persist": 1, "n_buffer": 2}, None])
def test_prepared_cpu_model_trains_on_gpu(plan):
    """A bf16 model built on the CPU, put into chunks on the GPU by `prepare` (most chunks in the host arena, or,
    with no plan, every chunk until the first compile's search places them): its losses follow eager fp32
    training under autocast within the bf16 tolerance, and the GPU never held the offloaded parameters."""
    ref = models.build("llama", layers=4)
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref = ref.cuda()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    largest = max(p.numel() * 2 for p in model.parameters())
    protrain_fx.prepare(model, plan=plan)
    assert all(p.is_cuda for p in model.parameters())
    manager = protrain_fx.manager_of(model)
    # prepare allocates on the GPU one persistent chunk (bf16, fp32 master, fp32 gradient), two bf16 buffers (with
    # no plan: no persistent chunk, one buffer), the fp32 landing area of a loaded shard, and one parameter in
    # passing (+ the allocator's 512-byte rounding)
    per_elem = (2 + 4 + 4 + 2 + 2 + 4) if plan else (2 + 4)
    assert torch.cuda.max_memory_allocated() - before <= manager.layout.chunk_elems * per_elem + largest + 8 * 512
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="protrain", dynamic=False)
    train_against_autocast(ref, ref_opt, compiled, opt)
    assert manager.pending_plan is None and manager.n_persist == protrain_fx.plan_of(model).n_persist


@pytest.mark.gpu
def test_a_waiting_managers_host_arena_is_let_go_when_placed():
    """A model prepared with no plan holds a gradient shard in a host arena until the first compile places its
    chunks; `place` builds the placed chunks' own, and the waiting one is freed (not pinned, which would hold it
    until the model is freed: host memory the plan counted as reused)."""
    import weakref

    model = protrain_fx.prepare(models.build("llama", layers=4).to(torch.bfloat16))
    manager = protrain_fx.manager_of(model)
    waiting = weakref.ref(manager.storage.arena)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="protrain", dynamic=False)
    compiled(**{k: v.cuda() for k, v in models.batch("llama").items()}).loss.backward()
    opt.step()
    assert manager.pending_plan is None and manager.storage.arena is not waiting()
    gc.collect()
    assert waiting() is None


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [{"n_persist": 0, "n_buffer": 2}, None])
def test_prepared_model_profiled_and_trained_under_a_memory_limit(plan):
    """A prepared 1B model at batch 8 under a 12 GiB limit on this process: profiling it whole would need about
    twice that (its profile says so), on demand it fits; the searched plan then trains within the limit (with no
    plan given to prepare, the search also places the chunks)."""
    limit = 12 * 2**30
    model = models.big_llama().cpu()
    protrain_fx.prepare(model, plan=plan)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-4)
    backend = protrain_fx.ProTrainBackend({"gpu_memory_bytes": limit})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    ids = torch.randint(0, 32000, (8, 1024), device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    try:
        torch.cuda.reset_peak_memory_stats()
        losses = train(
            compiled, "llama", 3, opt=opt, device="cuda", batch=lambda step: {"input_ids": ids, "labels": ids}
        )
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
    assert protrain_fx.manager_of(model).n_persist == plan.n_persist < plan.n_chunk
