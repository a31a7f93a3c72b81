"""NonfiniteFlags: whether a gradient of the step is inf or NaN, kept on the device (no sync), and that flag as each
update started during the backward saw it.

`found` is 1 once a checked gradient is not finite (`check`: the sum of the gradients' L2 norms, torch's foreach
norm accumulated in fp32, is not finite; each gradient is read once, and a norm also overflows past about 1e19, where
training has failed anyway). `AdamW.step()` reads it, and the fused AdamW skips an update where its flag is exactly 1.
An offloaded chunk's update during the backward reads a host copy of the flag made behind its gradient's copy
(`to_host`), a persistent chunk's a device copy (`early`): later gradients' flags do not reach an update already
started.

State it owns: the step's flag, and the copies of it per chunk. Made again at each placement (the persistent chunks'
count changes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class NonfiniteFlags:
    """The step's inf/NaN flag and its copies (module docstring)."""

    def __init__(self, n_chunk: int, on_device: int, device: torch.device):
        """`on_device`: the chunks updated on the device (the first ones: persistent, then sharded there)."""
        self.found = torch.zeros(1, device=device)  # 1 once a gradient of this step is not finite
        self._host = torch.zeros(n_chunk, pin_memory=device.type == "cuda")  # offloaded chunk -> its update's flag
        self._early = torch.zeros(on_device, device=device)  # chunk updated on the device -> its early update's flag

    def check(self, grads: Sequence[torch.Tensor]) -> None:
        """Set `found` to 1 if one of `grads` is inf or NaN (module docstring)."""
        norms = torch._foreach_norm(list(grads), 2, dtype=torch.promote_types(grads[0].dtype, torch.float32))
        nonfinite = torch.isfinite(torch.stack(norms).sum()).logical_not().to(self.found.dtype)
        torch.maximum(self.found, nonfinite, out=self.found)

    def to_host(self, chunk: int) -> torch.Tensor:
        """The flag as of now, copied without blocking into the offloaded `chunk`'s host flag (on the current stream:
        the caller's copy of its gradient); that flag."""
        flag = self._host[chunk]
        flag.copy_(self.found[0], non_blocking=True)
        return flag

    def early(self, chunk: int) -> torch.Tensor:
        """The flag as of now, copied into the device flag of `chunk` (updated on the device); that flag."""
        flag = self._early[chunk]
        flag.copy_(self.found[0])
        return flag

    def step_over(self) -> None:
        """The step is over: no gradient of the next one is checked yet."""
        self.found.zero_()
