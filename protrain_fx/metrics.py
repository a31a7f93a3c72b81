"""StepMetrics: a one-line log of training progress that a user turns on by creating it.

    metrics = protrain_fx.StepMetrics(compiled, every=10)
    for batch in loader:
        loss = compiled(**batch).loss
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        metrics.step(loss, tokens=batch["input_ids"].numel())

Every `every` steps it logs (logger `protrain_fx.metrics`, INFO, rank 0 only) the step, the loss, tokens/s over
the steps since the last line, model TFLOP/s (6 × parameters × tokens/s: a step's forward and backward matrix
products, without recompute), the peak GPU memory allocated since the last line and the host's peak resident
memory, and returns them as a dict (on every rank). Reading the loss waits for the device once per line, not
per step.
"""

from __future__ import annotations

import logging
import resource
import sys
import time

import torch
from torch import nn

from protrain_fx.distributed import rank_and_world_size
from protrain_fx.runtime.adopt import user_model

log = logging.getLogger(__name__)


class StepMetrics:
    def __init__(self, model: nn.Module, *, every: int = 1):
        model = user_model(model, "StepMetrics")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"StepMetrics' every must be a positive number of steps, got {every!r}")
        params = [p for p in model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in params)
        self.device = params[0].device if params else torch.device("cpu")
        self.every = every
        self.steps = 0
        self._tokens = 0
        self._since = time.perf_counter()

    def step(self, loss: torch.Tensor | float, tokens: int) -> dict | None:
        """Count one training step of `tokens` tokens; every `every` steps, log and return the metrics."""
        self.steps += 1
        self._tokens += int(tokens)
        if self.steps % self.every:
            return None
        loss_value = loss.detach().item() if isinstance(loss, torch.Tensor) else float(loss)  # (waits for the device)
        now = time.perf_counter()
        tokens_per_s = self._tokens / (now - self._since)
        row = {
            "step": self.steps,
            "loss": loss_value,
            "tokens_per_s": tokens_per_s,
            "tflops": 6 * self.n_params * tokens_per_s / 1e12,
            "gpu_peak_bytes": None,
            "host_peak_bytes": _host_peak_bytes(),
        }
        if self.device.type == "cuda":
            row["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if rank_and_world_size()[0] == 0:
            gpu = "-" if row["gpu_peak_bytes"] is None else f"{row['gpu_peak_bytes'] / 2**30:.2f} GiB"
            log.info(
                "step %d | loss %.4f | %.0f tokens/s | %.2f TFLOP/s | GPU peak %s | host peak %.2f GiB",
                row["step"],
                loss_value,
                tokens_per_s,
                row["tflops"],
                gpu,
                row["host_peak_bytes"] / 2**30,
            )
        self._tokens, self._since = 0, now
        return row


def _host_peak_bytes() -> int:
    """The process's peak resident memory (`ru_maxrss`: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
