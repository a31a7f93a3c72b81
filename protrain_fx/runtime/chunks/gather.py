"""Gatherer: the sharded chunks' parameters, whole, in device buffers while a compiled graph reads them.

A part the ChunkManager composes (`manager.gathering`), made again by each `rebuild` (a re-plan) and holding all
of its state:
- `buffers`: the plan's `n_buffer` compute-dtype chunk buffers on the device;
- `_landing`: where a master shard lands on the device before its cast into a buffer (None where the parameters are
  their own master: the shard is copied into the buffer directly);
- `copy_stream`: the CUDA stream of host-to-device chunk copies, so they overlap compute;
- `_freed`: buffer -> the event its last release recorded (a copy into it waits for the reads queued before);
- `_ready`: chunk -> its copy into a buffer is done; `_resident`: chunk -> the buffer holding it;
- `in_use`: chunks gathered and not released yet; `_released`: released chunks still in a buffer, least recent
  first (evicted in that order);
- `_buffered_version`: chunk -> the update (the source's `version`) its buffered copy holds.

What it reads of the chunks, it reads through `ChunkSource` (the manager): a chunk's master shard, its version,
whether its host update is pending, and waiting for that update.

`gather` copies this rank's master shard to the device (a chunk sharded on the device: casts it from where it is),
casts it into a buffer and all-gathers the rest; a chunk still in a buffer at its next gather (backward right after
forward) is not copied again unless updated since, and `prefetch` loads the next chunk ahead on the copy stream. Casting on the device costs PCIe bytes, which overlap
compute, instead of a host cast after every update, which would lengthen the host optimizer.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.distributed as dist

from protrain_fx.distributed import across_ranks


class ChunkSource(Protocol):
    """What a Gatherer reads of the chunks (the ChunkManager)."""

    def master_shard(self, chunk: int) -> torch.Tensor:
        """This rank's master shard of a sharded chunk (host memory, or the device's for a chunk sharded there)."""
        ...

    def version(self, chunk: int) -> int:
        """How many updates of `chunk` have been published."""
        ...

    def update_pending(self, chunk: int) -> bool:
        """Whether `chunk`'s host update is queued and not done."""
        ...

    def wait_for_update(self, chunk: int | None = None) -> None: ...


class Gatherer:
    """Gather, prefetch and release of the offloaded chunks (module docstring)."""

    def __init__(
        self,
        source: ChunkSource,
        *,
        n_buffer: int,
        chunk_elems: int,
        shard: tuple[int, int],
        dtype: torch.dtype,
        landing_dtype: torch.dtype | None,
        device: torch.device,
        world_size: int,
    ):
        """`shard`: this rank's (start, end) in a chunk; `landing_dtype`: the master dtype where it differs from
        the compute `dtype` (a shard lands in it before its cast), else None."""
        self.source = source
        self.n_buffer, self.shard, self.world_size, self.device = n_buffer, shard, world_size, device
        self.buffers = [torch.empty(chunk_elems, dtype=dtype, device=device) for _ in range(n_buffer)]
        # where a master shard lands on the device before its cast into a buffer (loads are serial on one stream)
        lo, hi = shard
        self._landing = None if landing_dtype is None else torch.empty(hi - lo, dtype=landing_dtype, device=device)
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None  # host-to-device chunk copies
        self._freed = [torch.cuda.current_stream(device).record_event() for _ in self.buffers] if cuda else []
        self._ready: dict[int, torch.cuda.Event] = {}  # chunk -> its copy into a buffer is done
        self._resident: dict[int, int] = {}  # chunk -> buffer holding it
        self.in_use: set[int] = set()  # chunks gathered and not released yet
        self._released: list[int] = []  # released chunks still in a buffer, least recent first
        self._buffered_version: dict[int, int] = {}  # chunk -> version its buffered copy holds

    def drop(self) -> None:
        """Let go of the buffers and the landing shard (a re-plan builds a new Gatherer): nothing is resident."""
        self.buffers, self._landing, self._resident, self._released, self._ready = [], None, {}, [], {}

    def device_tensors(self) -> list[torch.Tensor]:
        """The device memory it holds: the buffers and the landing shard."""
        return [*self.buffers, *([self._landing] if self._landing is not None else [])]

    def gather(self, chunk: int) -> torch.Tensor:
        """The chunk's parameters, whole, in a device buffer (copied in unless still resident or prefetched)."""
        self.source.wait_for_update(chunk)
        if chunk in self._released:
            self._released.remove(chunk)
        if not self._is_current(chunk):
            slot = self._resident.pop(chunk, None)
            slot = self._take_buffer() if slot is None else slot
            if slot is None:
                raise RuntimeError(
                    f"chunk {chunk} needs a buffer but all {self.n_buffer} hold chunks in use "
                    f"{sorted(self.in_use)}; the plan needs more chunk buffers (n_buffer)"
                )
            self._load(chunk, slot)
        ready = self._ready.pop(chunk, None)
        if ready is not None:  # loaded on the copy stream: compute waits for that copy only
            torch.cuda.current_stream(self.device).wait_event(ready)
        self.in_use.add(chunk)  # (only once it has a buffer: a gather that found none leaves nothing in use)
        return self.buffers[self._resident[chunk]]

    def prefetch(self, chunk: int) -> None:
        """Start loading `chunk` ahead of its gather if a buffer is free (or holds a released chunk) and its
        update is done; otherwise do nothing and let the gather load it."""
        if chunk in self.in_use or self._is_current(chunk) or self.source.update_pending(chunk):
            return
        self.source.wait_for_update(chunk)
        self._resident.pop(chunk, None)
        slot = self._take_buffer()
        if slot is not None:
            self._load(chunk, slot)

    def release(self, chunk: int) -> None:
        """The graph is done with the chunk for now; its buffer may be reused (least recently released first)."""
        self.in_use.discard(chunk)
        if chunk in self._resident and chunk not in self._released:
            self._released.append(chunk)
            if self.copy_stream is not None:  # a copy into this buffer must wait for the reads queued so far
                self._freed[self._resident[chunk]] = torch.cuda.current_stream(self.device).record_event()

    def abandon_step(self) -> None:
        """A forward or backward ran out of memory midway (runtime/oom.py): the chunks it gathered are released
        (they stay in their buffers, free for reuse)."""
        for chunk in sorted(self.in_use):
            self.release(chunk)

    def _is_current(self, chunk: int) -> bool:
        return chunk in self._resident and self._buffered_version.get(chunk) == self.source.version(chunk)

    def _load(self, chunk: int, slot: int) -> None:
        """Copy the chunk into buffer `slot` (H2D of this rank's shard, then all-gather). On CUDA the copy runs
        on the copy stream once compute is done with the buffer's previous chunk (the event its release
        recorded), so it overlaps compute; the event recorded after it is what the gather waits for."""
        buffer = self.buffers[slot]
        lo, hi = self.shard
        self._buffered_version[chunk] = self.source.version(chunk)
        self._resident[chunk] = slot
        stream = self.copy_stream
        master = self.source.master_shard(chunk)
        if stream is not None:
            stream.wait_event(self._freed[slot])
            if master.device == self.device:  # (sharded on the device: updated on the compute stream)
                stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            mine = buffer[lo:hi]
            if self._landing is None or master.device == self.device:  # (cast on the device where it is)
                mine.copy_(master, non_blocking=True)
            else:
                self._landing.copy_(master, non_blocking=True)
                mine.copy_(self._landing)
            if self.world_size > 1:
                with across_ranks(f"the all-gather of chunk {chunk}'s parameters"):
                    dist.all_gather_into_tensor(buffer, mine.clone())
            if stream is not None:
                self._ready[chunk] = stream.record_event()

    def _take_buffer(self) -> int | None:
        """A free buffer, else the one of the least recently released chunk (evicted), else None."""
        used = set(self._resident.values())
        free = [i for i in range(self.n_buffer) if i not in used]
        if free:
            return free[0]
        if self._released:
            return self._resident.pop(self._released.pop(0))
        return None
