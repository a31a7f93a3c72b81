"""Model FLOPs and the device's measured matmul rate, for TFLOP/s and MFU.

A decoder step does about 6 N FLOPs per token (N parameters: 2 N forward, 4 N backward); a block whose
activations are recomputed does its forward twice, 2 N_block more per token. MFU divides the model's FLOP rate
by the rate this device reaches on a large matmul of the same dtype (measured, not a data-sheet peak).
"""

from __future__ import annotations

import time

import torch
from torch import nn

MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated decoder blocks of a Hugging Face causal LM (bench/model.py's families)."""
    inner = getattr(model, "base_model", None)
    for path in ("layers", "decoder.layers", "h"):
        found = inner
        for part in path.split("."):
            found = getattr(found, part, None)
        if isinstance(found, nn.ModuleList):
            return found
    raise ValueError(f"no decoder layers found in {type(model).__name__}")


def parameter_count(module: nn.Module) -> int:
    """The module's parameter elements, whole also where DeepSpeed's ZeRO-3 has partitioned them (its
    parameters then hold nothing between uses and say their size in `ds_numel`)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def step_flops(model: nn.Module, tokens: int, recomputed_blocks: int = 0) -> tuple[float, float]:
    """(6 N tokens, the same with the recomputed blocks' second forward counted) for one training step."""
    params = parameter_count(model)
    layers = decoder_layers(model)
    per_block = parameter_count(layers[0]) if len(layers) else 0
    base = 6.0 * params * tokens
    return base, base + 2.0 * per_block * recomputed_blocks * tokens


def matmul_tflops(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """TFLOP/s of a square matmul of `dtype` on `device` (the best of `repeats` timed runs after a warm-up)."""
    n = MATMUL_SIZE[device.type]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first run warms up
            best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e12
