"""SwapSpace: where one compiled graph's swapped activations live between forward and backward (paper §3.2).

Each tensor that a swapped block saves for backward gets a fixed slot, decided at compile time, in one host
arena allocated once at its exact size (pinned with `cudaHostRegister` on CUDA). The rewritten graphs call:

    h = protrain.swap_out(space, slot, t)        # forward, after t's last use: copy t to its host slot
    protrain.swap_prefetch(space, slot, after)   # backward, a block ahead: start copying the slot back
    t = protrain.swap_in(space, slot, h)         # backward, before the first use: the device copy

On CUDA, copies run on their own streams. `swap_out` keeps the device tensor referenced until its copy's
event has completed (checked at every later swap op) instead of `record_stream`, so the allocator never sees
cross-stream uses; `swap_in` makes the compute stream wait for the prefetch's event only. On the CPU the
copies are plain copies into the same slots, in the same order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch

from protrain_fx.runtime import ops
from protrain_fx.runtime.host import check_host_memory, pinned_arena

log = logging.getLogger(__name__)


class SwapSpace:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.slots: list[torch.Tensor] = []
        self.handle = ops.register(self)
        cuda = self.device.type == "cuda"
        self._d2h = torch.cuda.Stream(self.device) if cuda else None
        self._h2d = torch.cuda.Stream(self.device) if cuda else None
        self._stored: dict[int, object] = {}  # slot -> event of its device-to-host copy
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # (event, device tensor) until the copy is done
        self._fetched: dict[int, tuple[torch.Tensor, object]] = {}  # slot -> (device tensor, event of its copy)

    def allocate(self, specs: Sequence[tuple[torch.Size, torch.dtype]]) -> None:
        """Compile time: one slot per swapped tensor (shape, dtype), all in one host arena."""
        sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
        aligned = [-(-n // 64) * 64 for n in sizes]  # 64-byte slot boundaries
        check_host_memory(
            sum(aligned),
            "the swapped activations",
            "one slot per tensor a swapped block saves for backward",
            "swap fewer blocks (checkpoint them instead), use a smaller batch",
        )
        self.arena = pinned_arena(sum(aligned), self, pin=self.device.type == "cuda")
        at = 0
        for (shape, dtype), n, step in zip(specs, sizes, aligned):
            self.slots.append(self.arena[at : at + n].view(dtype).view(shape))
            at += step
        log.info("swap space: %d tensors, %.1f MiB of host memory", len(specs), self.arena.numel() / 2**20)

    def _retire(self) -> None:
        """Drop the device tensors whose copy to the host has finished."""
        self._in_flight = [(ev, t) for ev, t in self._in_flight if not ev.query()]

    def swap_out(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        host = self.slots[slot]
        self._fetched.pop(slot, None)  # a copy fetched earlier and never taken holds an old value
        if self._d2h is None:
            host.copy_(t)
            return host
        self._retire()
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            host.copy_(t, non_blocking=True)
            event = self._d2h.record_event()
        self._stored[slot] = event
        self._in_flight.append((event, t))
        return host

    def prefetch(self, slot: int) -> None:
        if slot in self._fetched:
            return
        host = self.slots[slot]
        t = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        stream = self._h2d
        if stream is not None:
            self._retire()
            stream.wait_stream(torch.cuda.current_stream(self.device))  # t's allocation
            stored = self._stored.pop(slot, None)
            if stored is not None:
                stream.wait_event(stored)  # the slot holds this step's values
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            t.copy_(host, non_blocking=True)
            event = stream.record_event() if stream is not None else None
        self._fetched[slot] = (t, event)

    def swap_in(self, slot: int) -> torch.Tensor:
        self.prefetch(slot)  # nothing to do when prefetched
        t, event = self._fetched.pop(slot)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return t
