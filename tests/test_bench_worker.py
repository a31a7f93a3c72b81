"""The bench worker on CPU at tiny sizes: every model family trains, and the result carries TFLOP/s (with
recomputed blocks counted for a checkpointed protrain plan), MFU and the step's split; each family's presets build
the parameter counts the bench reports for them."""

import dataclasses
import json
import math

import pytest
import torch

from bench.model import FAMILIES, PRESET_PARAMS, PRESETS, ModelSpec, preset, resolve_init, spec_parameters
from bench.trainer import RESULT_PREFIX
from bench.worker import train

TINY = dict(hidden=32, layers=2, intermediate=64, heads=4, vocab=96, seq=16)
RUN = dict(batch=2, steps=2, warmup=1, dtype="float32", seed=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_eagerly(family):
    result = train("eager", ModelSpec(**TINY, family=family), **RUN)
    assert math.isfinite(result.loss_last) and len(result.losses) == 3
    assert result.tflops > 0 and result.tflops_recompute == result.tflops and 0 < result.mfu
    assert set(result.breakdown_s) == {"forward", "backward", "optimizer"}


@pytest.mark.parametrize("family", FAMILIES)
def test_presets_build_the_parameter_counts_reported(family):
    """`--preset` in each family (built on the meta device): the counts `--help` gives (PRESET_PARAMS), LLaMA's
    sizes within 2% for the families with presets of their own."""
    for name in PRESETS:
        spec = preset(name, family)
        assert spec.family == family and spec_parameters(spec) == PRESET_PARAMS[family][name], name
        if family in ("qwen2", "gpt_neox"):
            assert spec_parameters(spec) == pytest.approx(PRESET_PARAMS["llama"][name], rel=0.02)
    assert preset("5.5b", "qwen2").key_value_heads * 4 == preset("5.5b", "qwen2").heads  # (grouped-query)


def test_a_family_without_grouped_query_attention_refuses_kv_heads():
    from bench.model import _config

    with pytest.raises(ValueError, match="--kv-heads applies to"):
        _config(ModelSpec(**TINY, kv_heads=2, family="gpt_neox"))
    with pytest.raises(ValueError, match="must divide --heads"):
        _config(ModelSpec(**TINY, kv_heads=3, family="qwen2"))
    assert _config(dataclasses.replace(ModelSpec(**TINY), kv_heads=2, family="qwen2")).num_key_value_heads == 2


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_families_train_under_protrain_and_report_predictions(family, tmp_path):
    """`bench predict`'s path for the three families it compares: protrain-chunks with one block recomputed (so
    capture found the blocks) and a dump directory, long enough for the step monitor; its graph files make a row of
    the predict table with a prediction and a measurement."""
    from bench.predict import MONITOR_STEPS, _graph_files, format_table

    spec = ModelSpec(**TINY, kv_heads=2 if family == "qwen2" else 0, family=family)
    run = {**RUN, "steps": MONITOR_STEPS - RUN["warmup"]}
    plan = {"n_checkpoint": 1}
    result = train("protrain-chunks", spec, plan=plan, executor="eager", dump_dir=str(tmp_path), **run)
    assert all(math.isfinite(x) for x in result.losses)
    assert result.plan["n_checkpoint"] == 1 and len(result.plan["block_modes"]) == TINY["layers"]
    graphs = _graph_files(tmp_path)
    assert len(graphs) == 1 and graphs[0]["predicted_vs_measured"]["measured_step_s"] > 0
    row = format_table([{"forced": plan, "result": dataclasses.asdict(result), "graphs": graphs}]).splitlines()[-1]
    fields = "/".join(str(result.plan[k]) for k in ("n_persist", "n_buffer", "n_swap", "n_checkpoint"))
    assert "FAILED" not in row and fields in row


def test_recomputed_blocks_count_in_tflops():
    result = train("protrain-chunks", ModelSpec(**TINY), plan={"n_checkpoint": 1}, executor="eager", **RUN)
    # one of two blocks recomputed: its forward (2 N_block per token) on top of 6 N
    assert result.tflops < result.tflops_recompute < result.tflops * (1 + 1 / 3)
    assert result.plan["n_checkpoint"] == 1 and result.plan["predicted_step_s"] > 0  # the plan is in the report
    assert result.hardware["device_adam_s_per_param"] > 0  # and the hardware profile it was searched with


def test_prepared_models_train_as_the_one_built_in_place():
    """`init`: protrain-chunks' model built on the CPU (the same values) or the meta device (Hugging Face's own init
    as each module goes into chunks) and prepared, with no plan: it trains, its plan searched."""
    built = train("protrain-chunks", ModelSpec(**TINY), executor="eager", **RUN)
    on_cpu = train("protrain-chunks", ModelSpec(**TINY), executor="eager", init="cpu", **RUN)
    assert on_cpu.losses == built.losses and on_cpu.init == "cpu"
    on_meta = train("protrain-chunks", ModelSpec(**TINY), executor="eager", init="meta", **RUN)
    assert math.isfinite(on_meta.loss_last) and abs(on_meta.loss_first - math.log(96)) < 0.5  # (a fresh init)
    with pytest.raises(ValueError, match="--init 'cpu'"):
        train("compile", ModelSpec(**TINY), init="cpu", **RUN)
    assert built.init == "gpu"  # ("auto" on the CPU: built where it trains)


def test_trainer_runs_each_system_at_the_sizes_given(tmp_path, capsys):
    """`bench trainer` builds the model its size flags name (a family with grouped-query attention among them)
    and trains it under the Trainer, protrain with a forced offloaded plan and its executor."""
    from bench.cli import main

    sizes = [f"--{k}={v}" for k, v in TINY.items()] + ["--kv-heads=2", "--family=qwen2"]
    flags = ["--batch=2", "--steps=2", "--warmup=1", "--dtype=float32", f"--output-dir={tmp_path}"]
    plan = '{"n_persist": 1, "n_buffer": 1}'
    assert main(["trainer", *sizes, *flags, "--executor=eager", f"--plan={plan}", "--system=protrain"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1].removeprefix(RESULT_PREFIX))
    assert result["plan"]["n_persist"] == 1 and result["tokens_per_s"] > 0 and len(result["step_times_s"]) == 3


def test_auto_init_builds_where_a_user_would():
    """`--init auto`: on the GPU where the weights take at most half the GPU memory given, else on meta and
    prepared; systems without chunks and CPU runs always build in place; a named init is kept."""
    spec, cuda = ModelSpec(**TINY), torch.device("cuda")
    weights = (32 * 96 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32 + 32 * 96) * 2  # bf16 (LLaMA, untied head)
    assert resolve_init("auto", True, spec, torch.bfloat16, cuda, limit=2 * weights) == "gpu"
    assert resolve_init("auto", True, spec, torch.bfloat16, cuda, limit=2 * weights - 2) == "meta"
    assert resolve_init("auto", False, spec, torch.bfloat16, cuda, limit=weights) == "gpu"
    assert resolve_init("auto", True, spec, torch.bfloat16, torch.device("cpu"), limit=weights) == "gpu"
    assert resolve_init("cpu", True, spec, torch.bfloat16, cuda, limit=10 * weights) == "cpu"


@pytest.mark.filterwarnings("error:.*empty generator")  # (torch warns where it is handed no parameter)
def test_clipped_runs_train_alike(monkeypatch):
    """`clip`: each system clips every step with its own function (protrain_fx.clip_grad_norm_ on protrain,
    torch's on the others), and the losses agree."""
    import torch

    import protrain_fx

    calls = []
    for module, name in ((protrain_fx, "clip_grad_norm_"), (torch.nn.utils, "clip_grad_norm_")):
        clip = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _clip=clip, _name=module.__name__, **k: calls.append(_name) or _clip(*a, **k)
        )
    run = {**RUN, "steps": 3}
    eager, chunks = (
        train(system, ModelSpec(**TINY), clip=1e-3, executor="eager", **run) for system in ("eager", "protrain-chunks")
    )
    steps = len(eager.losses) + 3  # (and the 3 steps of the breakdown)
    assert calls == ["torch.nn.utils"] * steps + ["protrain_fx"] * steps, calls
    assert chunks.clip == 1e-3 and chunks.losses == pytest.approx(eager.losses, rel=1e-4)


def test_compile_amp_keeps_fp32_weights_and_computes_in_bf16():
    """compile-amp, the baseline of protrain's default fp32 masters: fp32 weights and AdamW states, the forward
    under bf16 autocast (its matmuls in bf16)."""
    import torch

    from bench.worker import _forward, _model_and_optimizer

    model, opt = _model_and_optimizer(
        "compile-amp", ModelSpec(**TINY), torch.device("cpu"), torch.bfloat16, 0, batch=2, clip=0.0
    )
    seen = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    ids = torch.randint(0, TINY["vocab"], (2, TINY["seq"]))
    _forward("compile-amp", model, torch.device("cpu"), torch.bfloat16)(ids).backward()
    opt.step()
    assert seen == [torch.bfloat16] and {p.dtype for p in model.parameters()} == {torch.float32}
    assert {t.dtype for st in opt.state.values() for k, t in st.items() if k != "step"} == {torch.float32}


def test_deepspeed_is_skipped_with_a_message_where_it_is_not_installed(monkeypatch, tmp_path, capsys):
    """Without the deepspeed package its systems are not run: `compare` reports them skipped, with why, and does
    not fail; the other commands leave them out."""
    import importlib.util
    import json

    from bench.cli import main, runnable

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a)
    )
    out = tmp_path / "compare.json"
    assert main(["compare", "--systems", "deepspeed-offload,deepspeed-offload-ac", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.count("SKIPPED: the deepspeed package is not installed (pip install deepspeed)") == 2
    results = json.loads(out.read_text())["results"]
    assert [r["system"] for r in results] == ["deepspeed-offload", "deepspeed-offload-ac"]
    assert all("pip install deepspeed" in r["skipped"] for r in results)
    assert runnable(["deepspeed-offload", "eager", "deepspeed-offload-ac"]) == ["eager"]  # (sweep, maxsize, scaling)


def test_deepspeed_trains(tmp_path):
    """Where deepspeed is installed, ZeRO-3 with parameters and AdamW on the host trains, each system in its own
    worker process as `compare` runs them (on the CPU: DeepSpeed's CPU accelerator), clipping in its own step,
    and counts its partitioned parameters whole."""
    pytest.importorskip("deepspeed")
    import json

    import transformers

    from bench.cli import main
    from bench.model import _config

    out = tmp_path / "compare.json"
    sizes = [arg for name, value in TINY.items() for arg in (f"--{name}", str(value))]
    run = ["--batch", "2", "--steps", "2", "--warmup", "1", "--dtype", "bfloat16", "--clip", "1.0"]
    assert (
        main(["compare", "--systems", "deepspeed-offload,deepspeed-offload-ac", *sizes, *run, "--out", str(out)]) == 0
    )
    plain, checkpointed = json.loads(out.read_text())["results"]
    whole = transformers.AutoModelForCausalLM.from_config(_config(ModelSpec(**TINY))).num_parameters()
    for result in (plain, checkpointed):
        assert all(math.isfinite(x) for x in result["losses"]) and result["losses"][-1] < result["losses"][0]
        assert result["params"] == whole and result["clip"] == 1.0
    assert plain["tflops_recompute"] == plain["tflops"] and checkpointed["tflops_recompute"] > checkpointed["tflops"]


def test_gpu_memory_limit_needs_a_gpu():
    with pytest.raises(ValueError, match="limits a CUDA device's memory"):
        train("eager", ModelSpec(**TINY), gpu_memory_gib=1.0, **RUN)


@pytest.mark.gpu
def test_gpu_memory_limit_holds_every_system_and_protrain_plans_for_it(tmp_path):
    """`gpu_memory_gib`: the caching allocator may hold that much of the GPU, and protrain searches its plan
    under it (planning.json's capacity), as on a GPU of that size."""
    import json

    import torch

    import protrain_fx  # noqa: F401  (registers the "protrain" backend)

    limit = 3 * 2**30
    try:
        result = train("protrain", ModelSpec(**TINY), gpu_memory_gib=3.0, dump_dir=str(tmp_path), **RUN)
        total = torch.cuda.get_device_properties(0).total_memory
        assert torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(limit / total)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)  # (the GPU tests after this one have all of it)
    [planning] = tmp_path.rglob("planning.json")
    assert json.loads(planning.read_text())["capacity_bytes"] == limit
    assert math.isfinite(result.loss_last)
    with pytest.raises(ValueError, match="this GPU has"):
        train("eager", ModelSpec(**TINY), gpu_memory_gib=total / 2**30 + 1, **RUN)


def test_compile_trains_under_an_activation_memory_budget():
    """`memory_budget`: compile's min-cut partitioner keeps at most that share of the activations for the run, and
    the setting is torch's again afterwards; a budget outside (0, 1] is refused."""
    import torch

    before = torch._functorch.config.activation_memory_budget
    result = train("compile", ModelSpec(**TINY), memory_budget=0.4, **RUN)
    assert result.memory_budget == 0.4 and math.isfinite(result.loss_last)
    assert torch._functorch.config.activation_memory_budget == before
    with pytest.raises(ValueError, match="--memory-budget must be in"):
        train("compile", ModelSpec(**TINY), memory_budget=0.0, **RUN)


def test_a_failing_rank_keeps_its_process_group_and_logs_its_error(monkeypatch, caplog):
    """A rank whose training raises does not tear its process group down (that waits for the collectives the other
    ranks are in, hiding the error behind a hang): the error is logged and raised. A rank that ends tears it down."""
    import torch
    import torch.distributed as dist

    from bench.worker import _free_port, _process_group

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "LOCAL_RANK": "0"}
    for name, value in {**env, "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="lost"), caplog.at_level("ERROR", logger="bench.worker"):
        with _process_group(torch.device("cpu")):
            raise RuntimeError("lost")
    try:
        assert dist.is_initialized() and "rank 0 failed" in caplog.text
    finally:
        dist.destroy_process_group()
    with _process_group(torch.device("cpu")):
        assert dist.is_initialized()
    assert not dist.is_initialized()
