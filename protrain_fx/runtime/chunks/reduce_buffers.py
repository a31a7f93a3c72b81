"""ReduceBuffers: the fp32 chunk-long buffers the backward's gradients are reduced in, used in turn.

A part the ChunkManager composes (`manager.reduce_buffers`, made again by each `rebuild`), holding all of its state:
the buffers (made at their first use, at most `count`), each one's shard across ranks where offloaded chunks are
reduce-scattered into one, the copy to the host that last read each, and which is next.

Before a buffer is reused the compute stream waits (on the device; the CPU goes on) until the copy to the host that
last read it (or its shard) has ended: gradients waiting for the link hold no more memory than these buffers, and
the backward slows down instead where the copies are slower than it. (Shards made anew for each chunk would pile up
while the copies lag, beyond what the plan counts.)
"""

from __future__ import annotations

import torch


class ReduceBuffers:
    """The reduce buffers of one placement of the chunks (module docstring)."""

    def __init__(
        self, count: int, *, chunk_elems: int, shard_elems: int | None, dtype: torch.dtype, device: torch.device
    ):
        """`count` buffers of `chunk_elems`; `shard_elems`: each buffer's shard where gradients are reduce-scattered
        (offloaded chunks across ranks), else None."""
        assert count >= 1, f"{count} reduce buffers"
        self.count, self.chunk_elems, self.shard_elems = count, chunk_elems, shard_elems
        self.dtype, self.device = dtype, device
        self.buffers: list[torch.Tensor] = []
        self.shards: list[torch.Tensor] = []
        self._read: list[torch.cuda.Event | None] = []  # buffer -> the copy to the host that last read it
        self._next = 0

    def take(self) -> tuple[torch.Tensor, int]:
        """The next buffer, zeroed, and its index, once the copy that last read it has ended (module docstring)."""
        i = self._next
        self._next = (i + 1) % self.count
        if i == len(self.buffers):
            self.buffers.append(torch.empty(self.chunk_elems, dtype=self.dtype, device=self.device))
            if self.shard_elems is not None:
                self.shards.append(torch.empty(self.shard_elems, dtype=self.dtype, device=self.device))
            self._read.append(None)
        read, self._read[i] = self._read[i], None
        if read is not None:
            torch.cuda.current_stream(self.device).wait_event(read)
        return self.buffers[i].zero_(), i

    def shard(self, i: int) -> torch.Tensor:
        """Buffer `i`'s shard (this rank's part of a reduce-scatter)."""
        return self.shards[i]

    def read_by(self, i: int, copied: torch.cuda.Event | None) -> None:
        """Buffer `i` (and its shard) is being read by the copy that records `copied` (None: done, on the CPU)."""
        self._read[i] = copied

    def device_tensors(self) -> list[torch.Tensor]:
        """The device memory it holds."""
        return [*self.buffers, *self.shards]
