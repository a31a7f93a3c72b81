"""SlotPool: the gradient buffers a group of chunks share in turn, one class for both groups.

- the persistent chunks' fp32 gradients on the device (the plan's `device_grad_slots`): a chunk takes one at its
  first gradient of a step and gives it back once its update is queued; the next taker's compute stream waits, on
  the device, for the update that last read it;
- the offloaded chunks' gradient shards on the host (the plan's `host_grad_slots`, views of the host arena): a chunk
  takes one when its first gradient of the step arrives and gives it back once its host update has run (on the
  worker thread, hence the lock).

With one slot per chunk each chunk holds its own for good and nothing is given back. With none free, the taker may
wait for a queued update that gives one back (`wait_for_one`), else takes memory for the step alone (`for_step`),
let go when given back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch


class SlotPool:
    """The slots `owned`, shared by the chunks `chunks`; what each chunk holds now is its entry of `grads` (the
    manager's chunk -> gradient dict, which both pools write, each its own chunks' entries)."""

    def __init__(
        self,
        owned: list[torch.Tensor],
        chunks: Sequence[int],
        grads: dict[int, torch.Tensor],
        *,
        device: torch.device,
        for_step: Callable[[int], torch.Tensor],
        wait_for_one: Callable[[], bool] | None = None,
    ):
        """`device`: where the slots are (CUDA: a slot given back carries the event of the update that read it).
        `for_step(chunk)`: memory for the chunk's gradient for this step, where none is free. `wait_for_one()`: wait
        for a queued update that gives a slot back; False where none is queued."""
        assert len(owned) <= len(chunks), f"{len(owned)} gradient slots for {len(chunks)} chunks"
        self.owned = owned
        self.grads = grads
        self.shared = len(owned) < len(chunks)
        self._cuda = device.type == "cuda"
        self._device = device
        self._for_step = for_step
        self._wait_for_one = wait_for_one
        # the slots no chunk holds now, each with the event of the last update that read it (None: nothing reads it)
        self.free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self.giving: set[int] = set()  # chunks whose queued update gives their slot back
        self.lock = threading.Lock()  # (the worker thread gives host slots back)
        if self.shared:
            self.free = [(t, None) for t in owned]
        else:
            grads.update(zip(chunks, owned))

    def take(self, chunk: int) -> torch.Tensor:
        """The gradient the chunk's gradient of this step goes into: the one it holds, or a free slot (on CUDA the
        compute stream waits, on the device, for the update that last read it). With none free: wait for a queued
        update that gives one back, else memory for this step (`for_step`)."""
        while True:
            with self.lock:
                grad = self.grads.get(chunk)
                if grad is None and self.free:
                    grad, read = self.free.pop()
                    if read is not None:
                        torch.cuda.current_stream(self._device).wait_event(read)
                    self.grads[chunk] = grad
                if grad is not None:
                    return grad
            if self._wait_for_one is None or not self._wait_for_one():
                break
        grad = self._for_step(chunk)
        with self.lock:
            self.grads[chunk] = grad
        return grad

    def give_back(self, chunk: int, stream: torch.cuda.Stream | None = None) -> None:
        """After the chunk's update (queued on `stream` on CUDA, default the current one; any thread): a shared slot
        is free again once that update has run; memory taken for the step alone is let go (on CUDA the allocator
        hands it out again once the update has run). A chunk's own slot stays."""
        if not self.shared:
            return
        with self.lock:
            self.giving.discard(chunk)
            grad = self.grads.pop(chunk, None)
            if grad is None:
                return
            on = (stream or torch.cuda.current_stream(self._device)) if self._cuda else None
            if any(grad is t for t in self.owned):
                self.free.append((grad, on.record_event() if on is not None else None))
            elif on is not None:
                grad.record_stream(on)
