"""Options are validated, and what the backend cannot handle fails with a message that says what to do."""

import copy
import io
import json
import subprocess
import sys

import models
import pytest
import torch
from helpers import train
from torch import nn

import protrain_fx
from protrain_fx.backend import check_torch_version
from protrain_fx.backend.sizes import NO_LIMIT_GROWTH
from protrain_fx.capture import check_inputs
from protrain_fx.config import ProTrainConfig
from protrain_fx.planner.plan import decisions


def test_defaults():
    config = ProTrainConfig.from_options(None)
    assert config.executor == "inductor" and config.gpu_memory_bytes is None and dict(config.plan) == {}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"exector": "eager"}, r"unknown protrain option\(s\) \['exector'\]; accepted options are \['executor'"),
        ({"executor": "tvm"}, r"option 'executor' must be one of \['inductor', 'eager'\]"),
        ({"gpu_memory_bytes": "8GB"}, r"option 'gpu_memory_bytes' must be an int"),
        ({"gpu_memory_bytes": -1}, r"must be positive"),
        ({"host_memory_bytes": 2.5e9}, r"option 'host_memory_bytes' must be an int"),
        ({"plan": 3}, r"option 'plan' must be a dict"),
        ({"plan": "/nonexistent/plan.json"}, r"not a file"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        ProTrainConfig.from_options(options)


def test_bad_option_through_torch_compile():
    compiled = torch.compile(models.build("toy"), backend="protrain", options={"bogus": 1})
    with pytest.raises(Exception, match="unknown protrain option"):
        compiled(**models.batch("toy"))


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"n_swapp": 1}, r"unknown plan field\(s\) \['n_swapp'\]"),
        ({"block_modes": ["none", "fast", "none"]}, r"unknown mode\(s\) \['fast'\]"),
        ({"block_modes": ["none"]}, r"has 1 entries but the model has 3 blocks"),
        ({"n_swap": 2, "n_checkpoint": 2}, r"more than the model's 3 blocks"),
        ({"n_checkpoint": 4}, r"more than the model's 3 blocks"),
    ],
)
def test_bad_forced_plan(plan, message):
    """Errors in a forced plan: at the backend's construction where the options alone show it, else at the
    first compile (Dynamo wraps what the backend raises)."""
    with pytest.raises(Exception, match=message):
        compiled = torch.compile(
            models.build("toy"), backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": plan})
        )
        compiled(**models.batch("toy"))


def test_plan_json_replays(tmp_path):
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "dump_dir": str(tmp_path)})
    torch.compile(models.build("toy"), backend=backend)(**models.batch("toy")).backward()
    plan_file = tmp_path / "rank0" / "graph0" / "plan.json"
    again = protrain_fx.ProTrainBackend({"executor": "eager", "plan": str(plan_file)})
    torch.compile(models.build("toy"), backend=again)(**models.batch("toy")).backward()
    replayed, searched = again.graphs[0].plan, backend.graphs[0].plan
    assert decisions(replayed.to_json()) == decisions(searched.to_json())
    assert replayed.predicted_reserved_bytes == searched.predicted_reserved_bytes
    assert again.graphs[0].plan.runners_up == ()  # every field given: not searched


def test_dynamic_shapes_of_a_model_naming_no_length_limit():
    """A model whose config names no length limit (the toy has none) is planned for NO_LIMIT_GROWTH times its first
    length, and trains like eager on every shape (tests/test_dynamic_shapes.py: models that name one)."""
    ref = models.build("toy")
    model = copy.deepcopy(ref)
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    compiled = torch.compile(model, backend=backend, dynamic=True)
    lengths = (12, 30, 7)
    batch = lambda step: models.batch("toy", seq=lengths[step])  # noqa: E731
    assert train(compiled, "toy", 3, batch=batch) == train(ref, "toy", 3, batch=batch)
    (record,) = [g for g in backend.graphs if g.shapes is not None]
    assert max(record.shapes.largest.values()) == NO_LIMIT_GROWTH * 12


def test_parameters_and_inputs_on_different_devices():
    param = nn.Parameter(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match="parameters are on meta but inputs are on \\['cpu'\\]"):
        check_inputs(torch.fx.symbolic_trace(lambda x: x), [param, torch.ones(4, 4)])
    other = nn.Parameter(torch.empty(4, 4))
    with pytest.raises(ValueError, match="parameters are on several devices"):
        check_inputs(torch.fx.symbolic_trace(lambda x: x), [param, other])


def test_unsupported_torch_version():
    with pytest.raises(RuntimeError, match=r"needs torch >= 2.11, found 2.5.1"):
        check_torch_version("2.5.1+cu121")
    check_torch_version("2.14.0a0+git")


def test_model_without_trainable_parameters():
    """Training a frozen model is an error that says what to do; inference under no_grad is not."""
    model = models.build("toy").requires_grad_(False)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}), dynamic=False)
    with pytest.raises(Exception, match="no trainable parameters .* or run inference under torch.no_grad"):
        compiled(**models.batch("toy"))
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(compiled(**models.batch("toy")), model(**models.batch("toy")))


def test_new_input_shape_gets_its_own_plan_and_a_warning(caplog):
    """A batch of another size recompiles (dynamic=False): a new profile and plan, and a warning saying so and how
    to keep one plan (pad to one shape); both shapes train."""
    model = models.build("toy")
    compiled = torch.compile(model, backend="protrain", options={"executor": "eager"}, dynamic=False)
    with caplog.at_level("WARNING", logger="protrain_fx"):
        compiled(**models.batch("toy")).backward()
        assert "recompiled" not in caplog.text
        compiled(**models.batch("toy", batch_size=4)).backward()
    assert "recompiled for input shapes [(4, 16), (4, 16)] (planned before for [(2, 16), (2, 16)])" in caplog.text
    assert "pad the inputs to one fixed shape" in caplog.text
    assert len(model.__dict__["_protrain_plans"]) == 2


def test_model_without_blocks_warns_and_trains(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    with caplog.at_level("WARNING", logger="protrain_fx"):
        torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
    assert "no transformer blocks" in caplog.text
    assert backend.graphs[0].plan.n_block == 0


def test_backend_found_by_entry_point_without_import():
    code = (
        "import torch, sys\n"
        "assert 'protrain' in torch._dynamo.list_backends()\n"
        "assert 'protrain_fx' not in sys.modules\n"
        "m = torch.nn.Linear(4, 4)\n"
        "torch.compile(m, backend='protrain', options={'executor': 'eager'})(torch.randn(2, 4)).sum().backward()\n"
        "assert 'protrain_fx' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_dump_dir_files(tmp_path, monkeypatch):
    monkeypatch.setenv("PROTRAIN_DUMP_DIR", str(tmp_path))
    compiled = torch.compile(models.build("gpt2", loss_break=True), backend="protrain", options={"executor": "eager"})
    compiled(**models.batch("gpt2")).loss.backward()
    graphs = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    assert graphs == ["graph0", "graph1"]  # GPT-2: model and loss
    g0 = tmp_path / "rank0" / "graph0"
    for name in [
        "forward.py",
        "backward.py",
        "joint.py",
        "profile.csv",
        "profile.json",
        "params.json",
        "blocks.json",
        "plan.json",
    ]:
        assert (g0 / name).stat().st_size > 0, name
    assert "def forward" in (g0 / "forward.py").read_text()
    params = json.loads((g0 / "params.json").read_text())
    assert "transformer.wte.weight" in {e["name"] for e in params.values()}
    assert [f["type_name"] for f in json.loads((g0 / "blocks.json").read_text())["families"]] == ["GPT2Block"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_long_phases_show_progress_on_a_terminal(monkeypatch, tmp_path):
    """Parameters into chunks, profiling and the hardware measurement show tqdm bars on rank 0 when stderr is a
    terminal, and nothing otherwise (a batch job's log). (The hardware measured at helpers.SMALL_HARDWARE's
    sizes: the bars are the test, not the figures.)"""
    from helpers import SMALL_HARDWARE

    from protrain_fx.profiler import microbench

    for name, value in SMALL_HARDWARE.items():
        monkeypatch.setattr(microbench, name, value)
    for terminal in (False, True):
        err = _Terminal() if terminal else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        model = models.build("toy")
        protrain_fx.optim.AdamW(model.parameters())
        options = {"executor": "eager", "plan": {"n_persist": 1, "n_buffer": 3}}
        monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path / str(terminal)))  # measure the hardware anew
        torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)(**models.batch("toy"))
        torch._dynamo.reset()
        shown = err.getvalue()
        for phase in ("parameters into chunks", "profiling", "measuring the hardware"):
            assert (f"protrain: {phase}" in shown) == terminal, (phase, shown[-300:])


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_inference_on_offloaded_chunks(executor):
    """Under no_grad AOTAutograd compiles an inference graph and runs no partitioner; the backend gives it the
    chunk passes, so it reads offloaded parameters through gather and release: eager's logits after a training
    step (which republishes the chunks), with inductor's CPU kernels to 1e-5. The training step compiles with
    the eager executor; the eager case compiles the inference graph with the same backend, the inductor case
    with an inductor backend of its own (inductor's training graphs are tested elsewhere: it compiles only the
    graph under test here)."""
    ref = models.build("llama", layers=2)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"executor": "eager", "plan": {"n_persist": 1, "n_buffer": 2}}
    training = protrain_fx.ProTrainBackend(options)
    compiled = torch.compile(model, backend=training, dynamic=False)
    batch = models.batch("llama")
    for m, o in ((ref, ref_opt), (compiled, opt)):
        m(**batch).loss.backward()  # (builds the chunks)
        o.step()
        o.zero_grad()
    backend = training if executor == "eager" else protrain_fx.ProTrainBackend({**options, "executor": executor})
    if backend is not training:
        compiled = torch.compile(model, backend=backend, dynamic=False)
    model.eval()
    ref.eval()
    with torch.no_grad():
        got, expected = compiled(**batch).logits, ref(**batch).logits
    if executor == "eager":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    inference = backend.graphs[-1].forward
    assert any(n.target is torch.ops.protrain.gather.default for n in inference.graph.nodes)
    torch._dynamo.reset()


def test_graph_of_another_model_of_the_same_class():
    """Two models of one class under one backend object: torch.compile would reuse the first model's graph for
    the second (it passes parameters in and guards on their shapes), but each graph is guarded on its model, so
    the second gets graphs of its own, rewritten for its own chunks."""
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": {"n_persist": 1, "n_buffer": 2}})
    kept = []
    for _ in range(2):
        model = models.build("toy")
        opt = protrain_fx.optim.AdamW(model.parameters())
        compiled = torch.compile(model, backend=backend, dynamic=False)
        compiled(**models.batch("toy")).backward()
        opt.step()
        kept.append(model)  # (alive, as a user's first model would be)
    assert len([g for g in backend.graphs if g.param_map]) == 2


def test_blocks_left_uncompiled_by_hf_checkpointing_are_told_once(caplog):
    """Hugging Face's own checkpointing may keep its layers out of every compiled graph (docs/limitations.md):
    where no graph runs a block, one warning says so and what to do."""
    model = models.build("llama", checkpointed=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with caplog.at_level("WARNING", logger="protrain_fx"):
        for step in range(2):
            compiled(**models.batch("llama", seed=step)).loss.backward()
            opt.step()
            opt.zero_grad()
    told = [r for r in caplog.records if "runs none of the model's blocks" in r.getMessage()]
    ran_blocks = any(g.block_map is not None and g.block_map.blocks_in_graph for g in backend.graphs)
    assert len(told) == (0 if ran_blocks else 1), [g.block_map.blocks_in_graph for g in backend.graphs]
