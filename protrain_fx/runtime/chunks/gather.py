"""GatherMixin: the offloaded chunks' parameters, whole, in device buffers while a compiled graph reads them.

State it owns (made by `_build_buffers`, again by `place`):
- `buffers`: the plan's `n_buffer` compute-dtype chunk buffers on the device;
- `_landing`: where a master shard lands on the device before its cast into a buffer (None where the parameters are
  their own master: the shard is copied into the buffer directly);
- `_copy_stream`: the CUDA stream of host-to-device chunk copies, so they overlap compute;
- `_freed`: buffer -> the event its last release recorded (a copy into it waits for the reads queued before);
- `_ready`: chunk -> its copy into a buffer is done; `_resident`: chunk -> the buffer holding it;
- `_in_use`: chunks gathered and not released yet; `_released`: released chunks still in a buffer, least recent
  first (evicted in that order);
- `_buffered_version`: chunk -> the update (`_version`, storage.py) its buffered copy holds.

`gather` copies this rank's master shard to the device, casts it into a buffer and all-gathers the rest; a chunk
still in a buffer at its next gather (backward right after forward) is not copied again unless updated since, and
`prefetch` loads the next chunk ahead on the copy stream. Casting on the device costs PCIe bytes, which overlap
compute, instead of a host cast after every update, which would lengthen the host optimizer.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from protrain_fx.distributed import across_ranks


class GatherMixin:
    """Gather, prefetch and release of the offloaded chunks (module docstring). Part of ChunkManager."""

    def _init_gather(self) -> None:
        self._buffered_version: dict[int, int] = {}  # chunk -> version its buffered copy holds

    def _build_buffers(self) -> None:
        """The chunk buffers and what says which chunk each holds, all empty."""
        offloaded = self.n_persist < self.layout.n_chunk
        self.buffers = [
            torch.empty(self.layout.chunk_elems, dtype=self.dtype, device=self.device) for _ in range(self.n_buffer)
        ]
        # where a master shard lands on the device before its cast into a buffer (loads are serial on one stream)
        self._landing = (
            None
            if self.own_master or not offloaded
            else torch.empty(self.layout.shard_elems, dtype=self.master_dtype, device=self.device)
        )
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None  # host-to-device chunk copies
        self._freed = [torch.cuda.current_stream(self.device).record_event() for _ in self.buffers] if cuda else []
        self._ready: dict[int, torch.cuda.Event] = {}  # chunk -> its copy into a buffer is done
        self._resident: dict[int, int] = {}  # chunk -> buffer holding it
        self._in_use: set[int] = set()  # chunks gathered and not released yet
        self._released: list[int] = []  # released chunks still in a buffer, least recent first

    @property
    def upload_stream(self):
        """The CUDA stream of host-to-device chunk copies (None on the CPU): swap prefetches queue behind it."""
        return self._copy_stream

    def gather(self, chunk: int) -> torch.Tensor:
        """The chunk's parameters, whole, in a device buffer (copied in unless still resident or prefetched)."""
        assert chunk >= self.n_persist, f"chunk {chunk} is persistent: its parameters are read directly"
        self._in_use.add(chunk)
        self.wait_for_update(chunk)
        if chunk in self._released:
            self._released.remove(chunk)
        if not self._is_current(chunk):
            slot = self._resident.pop(chunk, None)
            slot = self._take_buffer() if slot is None else slot
            if slot is None:
                raise RuntimeError(
                    f"chunk {chunk} needs a buffer but all {self.n_buffer} hold chunks in use "
                    f"{sorted(self._in_use)}; the plan needs more chunk buffers (n_buffer)"
                )
            self._load(chunk, slot)
        ready = self._ready.pop(chunk, None)
        if ready is not None:  # loaded on the copy stream: compute waits for that copy only
            torch.cuda.current_stream(self.device).wait_event(ready)
        return self.buffers[self._resident[chunk]]

    def prefetch(self, chunk: int) -> None:
        """Start loading `chunk` ahead of its gather if a buffer is free (or holds a released chunk) and its
        update is done; otherwise do nothing and let the gather load it."""
        pending = self._pending.get(chunk)
        if chunk in self._in_use or self._is_current(chunk) or (pending is not None and not pending.done()):
            return
        self.wait_for_update(chunk)
        self._resident.pop(chunk, None)
        slot = self._take_buffer()
        if slot is not None:
            self._load(chunk, slot)

    def _is_current(self, chunk: int) -> bool:
        return chunk in self._resident and self._buffered_version.get(chunk) == self._version.get(chunk, 0)

    def _load(self, chunk: int, slot: int) -> None:
        """Copy the chunk into buffer `slot` (H2D of this rank's shard, then all-gather). On CUDA the copy runs
        on the copy stream once compute is done with the buffer's previous chunk (the event its release
        recorded), so it overlaps compute; the event recorded after it is what the gather waits for."""
        buffer = self.buffers[slot]
        lo, hi = self._shard_bounds()
        self._buffered_version[chunk] = self._version.get(chunk, 0)
        self._resident[chunk] = slot
        stream = self._copy_stream
        if stream is not None:
            stream.wait_event(self._freed[slot])
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            mine = buffer[lo:hi]
            if self._landing is None:
                mine.copy_(self.master[chunk], non_blocking=True)
            else:
                self._landing.copy_(self.master[chunk], non_blocking=True)
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

    def release(self, chunk: int) -> None:
        """The graph is done with the chunk for now; its buffer may be reused (least recently released first)."""
        self._in_use.discard(chunk)
        if chunk in self._resident and chunk not in self._released:
            self._released.append(chunk)
            if self._copy_stream is not None:  # a copy into this buffer must wait for the reads queued so far
                self._freed[self._resident[chunk]] = torch.cuda.current_stream(self.device).record_event()

    def abandon_step(self) -> None:
        """A forward or backward ran out of memory midway (runtime/oom.py): the chunks it gathered are released
        (they stay in their buffers, free for reuse)."""
        for chunk in sorted(self._in_use):
            self.release(chunk)
