"""`prepare(model, weights=path)` and `protrain_fx.from_pretrained` load a Hugging Face checkpoint as transformers'
`from_pretrained` loads the same folder: each test writes one with `save_pretrained` and compares the prepared model
with `from_pretrained`'s: every value (bitwise: both copy the same checkpoint tensors, and a missing tensor is
drawn by the same `_init_weights` from the same seed), every dtype, and the load report of missing, unexpected and
mismatched keys (the same text, logged by transformers' `log_state_dict_report`).
"""

import contextlib
import copy
import logging

import models
import pytest
import torch
from safetensors import safe_open

import protrain_fx

OURS = "protrain_fx.runtime.pretrained"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _transformers_messages():
    """The messages transformers logs inside (the load report among them), caught by a handler on its loggers,
    removed after."""
    records = _Records()
    with pytest.MonkeyPatch.context() as patch:
        for name in ("transformers.modeling_utils", "transformers.configuration_utils"):
            logger = logging.getLogger(name)
            patch.setattr(logger, "handlers", [*logger.handlers, records])
        yield records.messages


def _from_pretrained(cls, path, seed=0, **kwargs):
    """`cls.from_pretrained(path)` (its random draws from `seed`) and the messages transformers logged."""
    with _transformers_messages() as messages, torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls.from_pretrained(path, **kwargs), messages


def _prepare(caplog, model, path, seed=0, **kwargs):
    """`protrain_fx.prepare(model, weights=path)` (its random draws from `seed`) and the warnings it logged."""
    caplog.clear()
    with torch.random.fork_rng(), caplog.at_level(logging.WARNING, logger=OURS):
        torch.manual_seed(seed)
        protrain_fx.prepare(model, weights=path, device="cpu", **kwargs)
    return [r.getMessage() for r in caplog.records if r.name == OURS]


def _reports(messages):
    return [m for m in messages if "LOAD REPORT" in m]


def _assert_loaded_alike(model, loaded):
    """Every tensor of the prepared `model` (parameters from its chunks, buffers) equal to `loaded`'s: the same
    names, dtypes and values."""
    state, expected = protrain_fx.full_state_dict(model), loaded.state_dict()
    assert list(state) == list(expected)
    for name, value in expected.items():
        assert state[name].dtype == value.dtype, (name, state[name].dtype, value.dtype)
        assert torch.equal(state[name], value), name
    buffers = dict(model.named_buffers())
    for name, value in loaded.named_buffers():
        assert buffers[name].dtype == value.dtype and torch.equal(buffers[name], value), name


def _meta_model_loads_alike(cls, config, path, caplog) -> None:
    """A model built on the meta device and prepared from `path` holds what `from_pretrained` loads, with the same
    (empty) load report."""
    loaded, messages = _from_pretrained(cls, path)
    with torch.device("meta"):
        model = cls(config)
    ours = _prepare(caplog, model, path)
    _assert_loaded_alike(model, loaded)
    assert _reports(ours) == _reports(messages) == []


def _keys(path):
    with safe_open(next(path.glob("*.safetensors")), framework="pt") as f:
        return set(f.keys())


def test_gpt_neox_folder_as_saved_by_transformers(tmp_path, caplog):
    """transformers saves GPT-NeoX's head as `embed_out.weight` (its conversion mapping, reversed) and renames it
    back on load: a model built on the meta device (buffers too) loads it whole, with no report, as from_pretrained
    does."""
    ref = models.build("gpt_neox")
    ref.save_pretrained(tmp_path)
    assert "embed_out.weight" in _keys(tmp_path) and "lm_head.weight" not in _keys(tmp_path)
    _meta_model_loads_alike(type(ref), ref.config, tmp_path, caplog)


def test_base_model_checkpoint_into_a_causal_lm_and_back(tmp_path, caplog):
    """A `LlamaModel` checkpoint (no `model.` prefix, no head) into `LlamaForCausalLM`: the prefix is added and the
    head, missing, is initialised by the model's `_init_weights` from the same random draws, reported as MISSING;
    the other way, the prefix is dropped and the head reported as UNEXPECTED."""
    from transformers import LlamaForCausalLM, LlamaModel

    ref = models.build("llama")
    base = LlamaModel(ref.config)
    base.save_pretrained(tmp_path / "base")
    ref.save_pretrained(tmp_path / "causal")
    for cls, folder, report in ((LlamaForCausalLM, "base", "MISSING"), (LlamaModel, "causal", "UNEXPECTED")):
        loaded, messages = _from_pretrained(cls, tmp_path / folder, seed=3)
        with torch.device("meta"):
            model = cls(ref.config)
        ours = _prepare(caplog, model, tmp_path / folder, seed=3)
        _assert_loaded_alike(model, loaded)
        assert _reports(ours) == _reports(messages) and len(_reports(ours)) == 1
        assert f"lm_head.weight | {report}" in _reports(ours)[0]


def test_bf16_checkpoint_keeps_its_dtype_unless_one_was_given(tmp_path, caplog):
    """A bf16 checkpoint into a model built in float32 with no dtype: from_pretrained loads it in bf16, RoPE's
    frequencies in float32; the prepared model too (cast, with a warning that says how to keep float32). Built
    with dtype=torch.float32, it stays float32, as `from_pretrained(path, dtype=torch.float32)` loads it."""
    from transformers import AutoModelForCausalLM

    ref = models.build("llama").to(torch.bfloat16)
    ref.save_pretrained(tmp_path)
    loaded, _ = _from_pretrained(type(ref), tmp_path)
    assert loaded.dtype == torch.bfloat16
    model = models.build("llama")
    assert model.dtype == torch.float32 and model.config.dtype is None
    ours = _prepare(caplog, model, tmp_path)
    _assert_loaded_alike(model, loaded)
    assert any("cast to it. To keep float32, build the model with that dtype" in m for m in ours)

    loaded, _ = _from_pretrained(type(ref), tmp_path, dtype=torch.float32)
    config = copy.deepcopy(ref.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert not any("cast" in m for m in _prepare(caplog, model, tmp_path))
    _assert_loaded_alike(model, loaded)
    assert model.dtype == torch.float32


def test_sharded_checkpoint_of_a_tied_model_into_an_empty_one(tmp_path, caplog):
    """Qwen2 (head tied to the embedding) saved in shards; a model built under accelerate's init_empty_weights,
    which leaves the head untied: tied as from_pretrained ties it, each value read from its shard."""
    from accelerate import init_empty_weights

    ref = models.build("qwen2")
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    loaded, messages = _from_pretrained(type(ref), tmp_path)
    with init_empty_weights(include_buffers=False):
        model = type(ref)(ref.config)
    ours = _prepare(caplog, model, tmp_path)
    _assert_loaded_alike(model, loaded)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert _reports(ours) == _reports(messages) == []


def test_moe_experts_merged_as_transformers_converts_them(tmp_path, caplog):
    """Mixtral's checkpoint holds each expert's weights apart (`experts.0.w1.weight`, ...); transformers'
    converters merge them into one tensor per layer (`experts.gate_up_proj`), made when its module is filled."""
    ref = models.build("mixtral")
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    _meta_model_loads_alike(type(ref), ref.config, tmp_path, caplog)


def test_mismatched_shapes_are_reported_and_refused(tmp_path, caplog):
    """A checkpoint with a smaller vocabulary than the model's: from_pretrained reports the mismatched keys, then
    raises; prepare logs the same report and raises before building anything."""
    from transformers import LlamaForCausalLM

    ref = models.build("llama")
    ref.save_pretrained(tmp_path)
    config = copy.deepcopy(ref.config)
    config.vocab_size = ref.config.vocab_size + 32
    with _transformers_messages() as messages, pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        LlamaForCausalLM.from_pretrained(tmp_path, config=config)
    model = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="does not fit LlamaForCausalLM .* from the checkpoint's own config"):
        _prepare(caplog, model, tmp_path)
    ours = _reports([r.getMessage() for r in caplog.records if r.name == OURS])
    assert ours == _reports(messages) and "MISMATCH" in ours[0]
    assert protrain_fx.manager_of(model) is None


@pytest.mark.parametrize("direction", ["gemma into llama", "llama into gemma"])
def test_a_checkpoint_of_another_architecture_is_refused(direction, tmp_path):
    """from_pretrained only warns that the config is of another model type, then loads what fits; prepare refuses,
    saying what to build instead."""
    from transformers import GemmaConfig, GemmaForCausalLM

    llama = models.build("llama")
    gemma = GemmaForCausalLM(
        GemmaConfig(
            vocab_size=models.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    )
    saved, into = (gemma, llama) if direction == "gemma into llama" else (llama, gemma)
    saved.save_pretrained(tmp_path)
    _, messages = _from_pretrained(type(into), tmp_path)
    assert any("to instantiate a model of type" in m for m in messages)  # (a warning, then it loads)
    with pytest.raises(ValueError, match="the checkpoint is of another architecture: .* Build the model from"):
        protrain_fx.prepare(into, weights=tmp_path, device="cpu")
    assert protrain_fx.manager_of(into) is None


def test_tied_weights_the_checkpoint_holds_apart_are_untied(tmp_path, caplog):
    """A config that ties the head to the embedding, and a checkpoint with both, of different values: from_pretrained
    warns and leaves them untied; so does prepare, on a model built tied."""
    from safetensors.torch import save_file

    ref = models.build("qwen2")
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
    ref.config.save_pretrained(tmp_path)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, messages = _from_pretrained(type(ref), tmp_path)
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    model = copy.deepcopy(ref)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ours = _prepare(caplog, model, tmp_path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    _assert_loaded_alike(model, loaded)
    assert [m for m in ours if "we will NOT tie them" in m] == [m for m in messages if "we will NOT tie them" in m]


def test_one_call_from_pretrained(tmp_path):
    """`protrain_fx.from_pretrained(cls, path)`: built on the meta device from the checkpoint's config and prepared
    from it; the model from_pretrained gives (bf16, eval mode), with its trainable parameters in chunks."""
    from transformers import AutoModelForCausalLM

    models.build("gpt_neox").to(torch.bfloat16).save_pretrained(tmp_path)
    loaded, _ = _from_pretrained(AutoModelForCausalLM, tmp_path)
    model = protrain_fx.from_pretrained(AutoModelForCausalLM, tmp_path, device="cpu")
    assert type(model) is type(loaded) and not model.training
    assert protrain_fx.manager_of(model) is not None
    _assert_loaded_alike(model, loaded)
