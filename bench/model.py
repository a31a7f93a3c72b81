"""The benchmarked model: a LLaMA-style decoder built from a transformers `LlamaConfig`, random weights, no download."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Model sizes. The defaults are about 0.95B parameters (16 blocks of 51M, untied 65M embedding and head)."""

    hidden: int = 2048
    layers: int = 16
    intermediate: int = 5632
    heads: int = 16
    vocab: int = 32000
    seq: int = 1024


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """A `LlamaForCausalLM` with SDPA attention, initialised on `device` from `seed`, then cast to `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        intermediate_size=spec.intermediate,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        vocab_size=spec.vocab,
        max_position_embeddings=spec.seq,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: the host never holds the fp32 weights
        model = LlamaForCausalLM(config)
    return model.to(device, dtype=dtype).train()


def random_batches(spec: ModelSpec, batch: int, n: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """`n` batches of uniform random token ids, shape (batch, seq), made on `device` from `seed`.

    The same seed gives the same batches to every system on one device, so their losses are comparable.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(0, spec.vocab, (batch, spec.seq), device=device, generator=gen) for _ in range(n)]
