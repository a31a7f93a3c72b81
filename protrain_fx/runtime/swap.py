"""SwapSpace: where one compiled graph's swapped activations live between forward and backward (paper §3.2).

Each tensor that a swapped block saves for backward gets a fixed slot, decided at compile time, in one host
arena allocated once at its exact size (pinned with `cudaHostRegister` on CUDA). The rewritten graphs call:

    h = protrain.swap_out(space, slot, t, order)            # forward, after t's last use: copy t to its slot
    protrain.swap_settle(space, [slots], [h..], [t..], a)   # forward, swap_interval blocks later (or at its
                                                            # end): those copies are done; t may be freed
    protrain.swap_prefetch(space, [slots], after)           # backward, swap_interval blocks ahead: copy a block back
    t = protrain.swap_in(space, slot, h, [after])           # backward, before the first use: the device copy

On CUDA, copies run on their own streams. A device tensor being copied to the host must keep its memory until
the copy has ended, against two reusers: the caching allocator (`swap_out` keeps a reference until the copy's
event has completed, instead of `record_stream`, so the allocator never sees cross-stream uses) and the
compiler, which plans the memory of the graph's own buffers and would hand `t`'s to the next kernel of its
shape right after `swap_out`, its last reader in the graph as written; the settle reads `t` too, so the
compiler keeps it until the settle, where the compute stream waits for the copy. `swap_in` makes the compute
stream wait for the prefetch's event only. On the CPU the copies are plain copies into the same slots, in the
same order.

Two rules keep prefetching from hurting (paper §3.2 and line 607):
- memory: a block is prefetched only when the device has room for it under `budget_bytes` (the planned peak);
  otherwise its tensors are copied back at their `swap_in`, when the memory they need is about to be used.
  On CUDA "room" is the allocator's allocated bytes plus the block's; on the CPU, with no allocator to ask, the
  bytes of prefetched tensors not yet taken.
- bandwidth: swap prefetches and parameter-chunk uploads share the host-to-device link. A prefetch first
  waits for every chunk upload queued so far (`upload_stream`, the chunk manager's copy stream), so a chunk
  the compute needs next never waits behind a swap; later uploads share the link with at most the tensors
  of one prefetched block, which the planner's swap interval leaves time for.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch

from protrain_fx.host import check_host_memory, pinned_arena
from protrain_fx.runtime import ops
from protrain_fx.shapes import strides_in

log = logging.getLogger(__name__)


class SwapSpace:
    def __init__(self, device: torch.device, *, budget_bytes: int | None = None, upload_stream=None):
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes  # prefetch only while the device stays under this (None: no limit)
        self.regions: list[torch.Tensor] = []  # each slot's bytes in the arena
        self.slots: list[torch.Tensor] = []  # each slot as the tensor it holds now (its sizes: the last swap_out's)
        self.handle = ops.register(self)
        self.deferred = 0  # blocks whose prefetch waited for their swap_in for lack of memory
        cuda = self.device.type == "cuda"
        self._d2h = torch.cuda.Stream(self.device) if cuda else None
        self._h2d = torch.cuda.Stream(self.device) if cuda else None
        self._uploads = upload_stream  # the parameter chunks' host-to-device stream, whose copies go first
        self._stored: dict[int, object] = {}  # slot -> event of its device-to-host copy
        self._in_flight: dict[int, tuple[object, tuple]] = {}  # slot -> (copy event, the device tensors it reads)
        self._fetched: dict[int, tuple[torch.Tensor, object]] = {}  # slot -> (device tensor, event of its copy)

    def allocate(self, specs: Sequence[torch.Tensor]) -> None:
        """Compile time: one slot per swapped tensor, all in one host arena. `specs`: a tensor (on the meta device)
        per slot at the largest sizes the graph is planned for, with the slot's dtype and layout: the swapped
        tensor's own where it is dense (a transpose, say), so that it comes back with the strides the compiled
        backward was built for (`swap_out_pass`). A call at smaller sizes uses the start of its slot."""
        sizes = [spec.numel() * spec.dtype.itemsize for spec in specs]
        aligned = [-(-n // 64) * 64 for n in sizes]  # 64-byte slot boundaries
        check_host_memory(
            sum(aligned),
            "the swapped activations",
            "one slot per tensor a swapped block saves for backward",
            "swap fewer blocks (checkpoint them instead), use a smaller batch",
        )
        self.arena = pinned_arena(sum(aligned), self, pin=self.device.type == "cuda")
        at = 0
        for spec, n, step in zip(specs, sizes, aligned):
            self.regions.append(self.arena[at : at + n])
            self.slots.append(self.regions[-1].view(spec.dtype).as_strided(spec.shape, spec.stride()))
            at += step
        log.info("swap space: %d tensors, %.1f MiB of host memory", len(specs), self.arena.numel() / 2**20)

    def abandon(self) -> None:
        """A forward or backward ran out of memory midway (runtime/oom.py): wait for the copies it started and
        drop the device tensors it held here; the slots are written again by the next forward."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._in_flight.clear()
        self._fetched.clear()
        self._stored.clear()

    def _retire(self) -> None:
        """Drop the device tensors whose copy to the host has finished."""
        self._in_flight = {s: (ev, t) for s, (ev, t) in self._in_flight.items() if not ev.query()}

    def _slot_for(self, slot: int, t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
        """Slot `slot` as a dense tensor of `t`'s sizes in the layout `order` (shapes.dense_order)."""
        host = self.slots[slot]
        stride = strides_in(t.shape, order)
        if host.shape != t.shape or host.stride() != tuple(stride):
            n = t.numel() * t.element_size()
            region = self.regions[slot]
            assert n <= region.numel(), f"swap slot {slot} holds {region.numel()} bytes, a tensor of {n} came"
            host = self.slots[slot] = region[:n].view(t.dtype).as_strided(t.shape, stride)
        return host

    def swap_out(self, slot: int, t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
        host = self._slot_for(slot, t, order)
        self._fetched.pop(slot, None)  # a copy fetched earlier and never taken holds an old value
        if self._d2h is None:
            host.copy_(t)
            return host
        self._retire()
        source = t
        if t.stride() != host.stride():
            # laid out unlike its slot (heads split from a fused projection): copied to the slot's layout on the
            # device first, or copy_ would stage it through pageable host memory, blocking the host; allocated on
            # the compute stream, whose pool gets it back once the copy is over (_retire)
            source = torch.empty_strided(host.shape, host.stride(), dtype=t.dtype, device=t.device)
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            if source is not t:
                source.copy_(t)
            host.copy_(source, non_blocking=True)
            event = self._d2h.record_event()
        self._stored[slot] = event
        self._in_flight[slot] = (event, (t, source))
        return host

    def settle(self, slots: Sequence[int]) -> None:
        """The compute stream waits for the swap-out copies of `slots`, and their device tensors go: from here on
        they hold no device memory, whatever the copies' pace was, and the graph may reuse it (the settle is
        their last reader there)."""
        stream = torch.cuda.current_stream(self.device) if self._d2h is not None else None
        for slot in slots:
            event, _ = self._in_flight.pop(slot, (None, None))
            if event is not None:
                stream.wait_event(event)

    def prefetch(self, slots: Sequence[int]) -> None:
        """Start copying one block's `slots` back to the device, if the memory is there (module docstring)."""
        slots = [s for s in slots if s not in self._fetched]
        need = sum(self.slots[s].nbytes for s in slots)
        if self.budget_bytes is not None and self._allocated() + need > self.budget_bytes:
            self.deferred += 1
            log.debug("swap prefetch of %d tensors (%d bytes) deferred to their use: over budget", len(slots), need)
            return
        for slot in slots:
            self._fetch(slot)

    def _allocated(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return sum(t.nbytes for t, _ in self._fetched.values())

    def _fetch(self, slot: int) -> None:
        host = self.slots[slot]
        t = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        stream = self._h2d
        if stream is not None:
            self._retire()
            stream.wait_stream(torch.cuda.current_stream(self.device))  # t's allocation
            if self._uploads is not None:
                stream.wait_stream(self._uploads)  # parameter chunks queued so far go first
            stored = self._stored.pop(slot, None)
            if stored is not None:
                stream.wait_event(stored)  # the slot holds this step's values
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            t.copy_(host, non_blocking=True)
            event = stream.record_event() if stream is not None else None
        self._fetched[slot] = (t, event)

    def swap_in(self, slot: int) -> torch.Tensor:
        if slot not in self._fetched:  # not prefetched (no room then, or no block ahead of it)
            self._fetch(slot)
        t, event = self._fetched.pop(slot)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return t
