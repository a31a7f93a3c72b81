"""The benchmarked models: decoders built from transformers configs, random weights, no download.

Families (`--family`): llama (the default), mistral, opt and gpt2 build LLaMA's sizes in their architecture; qwen2
(grouped-query attention: a quarter as many key/value heads as query heads, biases on q, k and v) and gpt_neox
(attention and MLP in parallel from one input, a GELU MLP of two matrices, LayerNorms with biases, one fused qkv
projection with biases, rotary embeddings on a quarter of each head) have sizes of their own, in their
proportions, at LLaMA's parameter counts (`FAMILY_PRESETS`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Model sizes. The defaults are about 0.95B parameters (16 blocks of 51M, untied 65M embedding and head)."""

    hidden: int = 2048
    layers: int = 16
    intermediate: int = 5632
    heads: int = 16
    kv_heads: int = 0  # key/value heads of grouped-query attention (llama, mistral, qwen2); 0: as many as `heads`
    vocab: int = 32000
    seq: int = 1024
    family: str = "llama"  # one of FAMILIES

    @property
    def key_value_heads(self) -> int:
        return self.kv_heads or self.heads

    @classmethod
    def from_args(cls, args) -> ModelSpec:
        """The sizes given on the command line (bench/cli.py sets every field's flag, presets applied)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


FAMILIES = ("llama", "mistral", "opt", "gpt2", "qwen2", "gpt_neox")  # (_CONFIGS below: how each names the sizes)
GQA_FAMILIES = ("llama", "mistral", "qwen2")  # those whose attention may have fewer key/value heads (`kv_heads`)


# `--preset`: 1b is the defaults; 5.5b is 26 blocks of 202M, untied 131M embedding and head. Each family builds these
# sizes in its architecture unless FAMILY_PRESETS has its own
PRESETS = {
    "1b": ModelSpec(),
    "5.5b": ModelSpec(hidden=4096, layers=26, intermediate=11008, heads=32, vocab=32000, seq=1024),
}
# sizes in a family's own proportions, as many blocks as LLaMA's and about as many parameters: qwen2 has 16 query
# heads to 4 key/value heads (32 to 8 at 5.5b) and a wider MLP where its attention is smaller; gpt_neox's MLP is 4
# times the hidden size
FAMILY_PRESETS = {
    "qwen2": {
        "1b": ModelSpec(intermediate=6656, kv_heads=4, family="qwen2"),
        "5.5b": ModelSpec(hidden=4096, layers=26, intermediate=13056, heads=32, kv_heads=8, family="qwen2"),
    },
    "gpt_neox": {
        "1b": ModelSpec(intermediate=8192, family="gpt_neox"),
        "5.5b": ModelSpec(hidden=4096, layers=26, intermediate=16384, heads=32, family="gpt_neox"),
    },
}
# the parameters each preset builds in each family (`spec_parameters`; tests/test_bench_worker.py checks them)
PRESET_PARAMS = {
    "llama": {"1b": 953_223_168, "5.5b": 5_524_115_456},
    "mistral": {"1b": 953_223_168, "5.5b": 5_524_115_456},
    "opt": {"1b": 705_560_576, "5.5b": 4_225_973_760},
    "gpt2": {"1b": 705_556_480, "5.5b": 4_225_965_568},
    "qwen2": {"1b": 953_272_320, "5.5b": 5_524_275_200},
    "gpt_neox": {"1b": 936_808_448, "5.5b": 5_498_028_032},
}


def preset(name: str, family: str = "llama") -> ModelSpec:
    """The sizes `--preset name` gives `family`: its own (FAMILY_PRESETS), else LLaMA's in its architecture."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {list(PRESETS)}")
    own = FAMILY_PRESETS.get(family, {})
    return own[name] if name in own else dataclasses.replace(PRESETS[name], family=family)


def spec_parameters(spec: ModelSpec) -> int:
    """The parameters the model of `spec` has, counted on a model built on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config(spec)).num_parameters()


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """The causal LM of `spec.family` with SDPA attention, initialised on `device` from `seed`, then cast to
    `dtype`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if torch.device(device).type == "meta":  # (nothing allocated: protrain_fx.prepare(init=...) fills it)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(_config(spec), dtype=dtype).train()
    with torch.device(device):  # initialise on the device: the host never holds the fp32 weights
        model = AutoModelForCausalLM.from_config(_config(spec))
    return model.to(device, dtype=dtype).train()


def build_prepared_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int, init: str) -> nn.Module:
    """`build_model` where `init` says ("gpu": on `device`); built on the CPU or the meta device, the model is put
    into chunks on `device` by `protrain_fx.prepare` (on meta, each module initialised by Hugging Face's own
    `_init_weights` as it goes into chunks), as a model larger than the GPU is."""
    import protrain_fx

    if init == "gpu":
        return build_model(spec, device, dtype, seed)
    model = build_model(spec, torch.device(init), dtype, seed)
    return protrain_fx.prepare(model, device=device, init=model._init_weights if init == "meta" else None)


def resolve_init(
    init: str, chunked: bool, spec: ModelSpec, dtype: torch.dtype, device: torch.device, limit: int
) -> str:
    """`init`, where "auto" is what a user would do: build the model on the GPU where its weights in `dtype` take
    at most half of the GPU memory it may use (`limit` bytes, 0: all), leaving the rest for training; else, where
    the system trains protrain's chunks (`chunked`), build it on the meta device and prepare it chunk by chunk."""
    if init != "auto":
        return init
    if not chunked or device.type != "cuda":
        return "gpu"
    capacity = limit or torch.cuda.get_device_properties(device).total_memory
    weights = spec_parameters(spec) * dtype.itemsize
    return "gpu" if weights <= capacity / 2 else "meta"


def build_deepspeed_model(
    spec: ModelSpec, dtype: torch.dtype, seed: int, *, batch: int, lr: float, clip: float, checkpoint: bool
):
    """The same model under DeepSpeed ZeRO-3 with its parameters and AdamW offloaded to the host: (engine,
    optimizer). The parameters are partitioned as they are built (`deepspeed.zero.Init`), so the whole model is
    never on the GPU; DeepSpeed computes in `dtype` (bf16 or fp16, with its loss scaling) and keeps fp32 masters
    and AdamW states on the host, where its CPU Adam (a C++ op DeepSpeed compiles on first use) updates them.
    `clip` > 0: DeepSpeed clips the gradient norm to it in `engine.step()`. `checkpoint`: Hugging Face's activation
    checkpointing of every decoder layer. Initialised by Hugging Face's own init from `seed`, not as `build_model`
    does, so losses compare only roughly. Needs a process group; on a machine without CUDA DeepSpeed's CPU
    accelerator runs it (a smoke run: nothing is offloaded there)."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_config = _config(spec)
    # imported before zero.Init, which patches tensor construction: the model's module imports torch._dynamo, whose
    # import does not survive the patch
    MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    host = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "zero_optimization": {"stage": 3, "offload_param": host, "offload_optimizer": host},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},  # (torch's AdamW default)
        "gradient_clipping": clip,
        "steps_per_print": 2**31 - 1,  # (no progress lines of its own)
    }
    torch.manual_seed(seed)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_config(model_config)
    if checkpoint:  # (transformers 5 renamed it)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, optimizer


def build_fsdp2_model(
    spec: ModelSpec, device: torch.device, param_dtype: torch.dtype, seed: int, *, checkpoint: bool
) -> nn.Module:
    """The same model under FSDP2 with CPU offload: fp32 weights on the host, computing in `param_dtype` on `device`.

    Built on the meta device, so that the whole model is never on the GPU: each decoder layer is wrapped for
    activation checkpointing (if `checkpoint`) and sharded, then the root; then the parameters are materialized on
    the CPU and initialised there from `seed`, but not as `build_model` does (normal(0, 0.02) per parameter, norms
    1: the same distribution, other values, so losses compare only roughly). Needs a process group; meant for one
    rank (with more, every rank would draw the same values into its own shard). On a CPU `device` there is no
    offload policy: pinning the host shards needs an accelerator, and a CPU run only exercises the code path.
    """
    from torch.distributed import get_world_size
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from bench.flops import decoder_layers

    if device.type == "cpu":
        log.warning("compute on the CPU: FSDP2 without CPUOffloadPolicy (pinned host shards need an accelerator)")
    fsdp = {
        "mesh": init_device_mesh(device.type, (get_world_size(),)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        "offload_policy": OffloadPolicy() if device.type == "cpu" else CPUOffloadPolicy(),
    }
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(spec))
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # checkpoint_wrapper, not HF's gradient_checkpointing_enable: wrapping before fully_shard puts FSDP2's
        # unshard/reshard hooks outside the checkpointed region (the torchtitan recipe), so the recomputation in
        # backward runs on the parameters FSDP2's pre-backward hook gathered and does not re-enter its forward hooks
        layers[i] = fully_shard(checkpoint_wrapper(layer) if checkpoint else layer, **fsdp)
    fully_shard(model, **fsdp)
    model.to_empty(device="cpu")  # FSDP2 pins the offloaded shards here
    _init_weights(model, seed)
    rotary = getattr(model.base_model, "rotary_emb", None)
    # inv_freq (a non-persistent buffer) was computed on the meta device, so to_empty left garbage: recompute it
    for name, buffer in type(rotary)(config=model.config).named_buffers() if rotary is not None else ():
        setattr(rotary, name, buffer.to(device))
    return model.train()


def random_batches(spec: ModelSpec, batch: int, n: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """`n` batches of uniform random token ids, shape (batch, seq), made on `device` from `seed`.

    The same seed gives the same batches to every system on one device, so their losses are comparable.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(0, spec.vocab, (batch, spec.seq), device=device, generator=gen) for _ in range(n)]


# fine-tuning data (bench --data finetune): each sequence's length log-uniform between these bounds (the model's
# sequence length above), each batch padded to its longest, as DataCollatorWithPadding pads
FINETUNE_SHORTEST = 64


def finetune_batches(
    spec: ModelSpec, batch: int, n: int, device: torch.device, seed: int, *, pad: bool = False
) -> tuple[list[torch.Tensor], list[int]]:
    """`n` batches of random token ids whose lengths vary as fine-tuning data's do (FINETUNE_SHORTEST to
    `spec.seq`, log-uniform per sequence, each batch as long as its longest), and each batch's real (unpadded)
    token count. `pad`: every batch padded to `spec.seq` instead, the same sequences (the same real tokens)."""
    gen = torch.Generator().manual_seed(seed)
    low, high = math.log(FINETUNE_SHORTEST), math.log(spec.seq)
    batches, real = [], []
    for _ in range(n):
        lengths = (torch.rand(batch, generator=gen) * (high - low) + low).exp().long().clamp(max=spec.seq)
        longest = spec.seq if pad else int(lengths.max())
        batches.append(torch.randint(0, spec.vocab, (batch, longest), generator=gen).to(device))
        real.append(int(lengths.sum()))
    return batches, real


_LLAMA_FIELDS = dict(
    hidden_size="hidden",
    num_hidden_layers="layers",
    intermediate_size="intermediate",
    num_attention_heads="heads",
    num_key_value_heads="key_value_heads",
    max_position_embeddings="seq",
)
# per family: the transformers config class, and which of its fields holds which ModelSpec size
_CONFIGS = {
    "llama": ("LlamaConfig", _LLAMA_FIELDS),
    "mistral": ("MistralConfig", _LLAMA_FIELDS),
    "opt": (
        "OPTConfig",
        dict(
            hidden_size="hidden",
            num_hidden_layers="layers",
            ffn_dim="intermediate",
            num_attention_heads="heads",
            max_position_embeddings="seq",
            word_embed_proj_dim="hidden",
        ),
    ),
    "gpt2": (
        "GPT2Config",
        dict(n_embd="hidden", n_layer="layers", n_inner="intermediate", n_head="heads", n_positions="seq"),
    ),
    "qwen2": ("Qwen2Config", _LLAMA_FIELDS),
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(
            hidden_size="hidden",
            num_hidden_layers="layers",
            intermediate_size="intermediate",
            num_attention_heads="heads",
            max_position_embeddings="seq",
        ),
    ),
}


def _config(spec: ModelSpec):
    import transformers

    if spec.family not in _CONFIGS:
        raise ValueError(f"unknown model family {spec.family!r}; choose from {FAMILIES}")
    if spec.kv_heads and spec.family not in GQA_FAMILIES:
        raise ValueError(f"--kv-heads applies to {GQA_FAMILIES}; {spec.family} has one key/value head per head")
    if spec.heads % spec.key_value_heads:
        raise ValueError(f"--kv-heads {spec.kv_heads} must divide --heads {spec.heads}")
    name, fields = _CONFIGS[spec.family]
    sizes = {field: getattr(spec, size) for field, size in fields.items()}
    return getattr(transformers, name)(vocab_size=spec.vocab, use_cache=False, attn_implementation="sdpa", **sizes)


def _init_weights(model: nn.Module, seed: int) -> None:
    """Norm weights 1 and biases 0, every other parameter normal(0, 0.02): each from its own generator, on host
    threads."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    norm_modules = [m for m in model.modules() if "Norm" in type(m).__name__]
    norms = {id(m.weight) for m in norm_modules if getattr(m, "weight", None) is not None}
    zeros = {id(m.bias) for m in norm_modules if getattr(m, "bias", None) is not None}
    seeds = torch.randint(2**62, (len(params),), generator=torch.Generator().manual_seed(seed)).tolist()

    @torch.no_grad()  # grad mode is per thread
    def init(param: nn.Parameter, param_seed: int) -> None:
        local = param.to_local() if isinstance(param, DTensor) else param
        if id(param) in norms:
            local.fill_(1.0)
        elif id(param) in zeros:
            local.zero_()
        else:
            local.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(param_seed))

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(init, params, seeds))  # list(): raise what a thread raised
