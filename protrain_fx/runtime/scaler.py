"""protrain_fx.amp.GradScaler: dynamic loss scaling for float16 models in chunks, with torch.amp.GradScaler's
interface; it hands protrain_fx.optim.AdamW (runtime/optim.py) the scale, which the fused update divides out.
"""

from __future__ import annotations

import torch

from protrain_fx.runtime.optim import AdamW


class GradScaler:
    """Dynamic loss scaling for float16 models in chunks, with `torch.amp.GradScaler`'s interface:

        scaler = protrain_fx.amp.GradScaler()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # only before clipping: protrain_fx.clip_grad_norm_(model, max_norm)
        scaler.step(optimizer)      # unscales inside the fused AdamW; skips the step on inf/NaN
        scaler.update()             # halves the scale after a skipped step, doubles it after growth_interval good ones

    (`torch.amp.GradScaler` cannot be used: it unscales `param.grad`, and these gradients live in the chunks.)
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(
                f"GradScaler got init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor="
                f"{backoff_factor}, growth_interval={growth_interval}; need init_scale > 0, growth_factor > 1, "
                "0 < backoff_factor < 1 and growth_interval >= 1"
            )
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._good_steps = 0
        self._skipped: bool | None = None

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs * self._scale

    def unscale_(self, optimizer: AdamW) -> None:
        """Before `protrain_fx.clip_grad_norm_`, as with torch.amp.GradScaler. The gradients are not divided here
        (that would cost a pass over every offloaded shard on the host): they keep the scale, clipping reads it
        from the optimizer to clip their unscaled norm, and the fused AdamW divides it out at `step()`."""
        _check_adamw(optimizer)
        if optimizer.carried_scale is not None:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last step()")
        optimizer.carried_scale = self._scale

    def step(self, optimizer: AdamW, *args, **kwargs):
        _check_adamw(optimizer)
        result = optimizer.step(*args, grad_scale=self._scale, **kwargs)
        self._skipped = optimizer.last_step_skipped
        return result

    def update(self, new_scale: float | None = None) -> None:
        if new_scale is not None:
            self._scale = float(new_scale)
        elif self._skipped:
            self._scale *= self.backoff_factor
            self._good_steps = 0
        elif self._skipped is not None:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self._scale *= self.growth_factor
                self._good_steps = 0
        self._skipped = None

    def get_scale(self) -> float:
        return self._scale

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self._scale, self._good_steps = float(state["scale"]), int(state["growth_tracker"])


def _check_adamw(optimizer) -> None:
    if not isinstance(optimizer, AdamW):
        raise TypeError(
            f"protrain_fx.amp.GradScaler steps a protrain_fx.optim.AdamW, got {type(optimizer).__name__}; "
            "use torch.amp.GradScaler for other optimizers"
        )
