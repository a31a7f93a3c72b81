"""PlacementMixin: which chunks live on the device, and the parameters' values moved into the chunks.

At construction `_adopt` moves every parameter's values into its chunk (an offloaded parameter keeps its shape on the
chunks' device, not its storage). A manager built by `protrain_fx.prepare` without `n_persist` is pending
(`pending_plan`: the plan fields forced so far): every chunk is offloaded, each master shard in host memory of its
own, until the first compile's plan `place`s the chunks, rebuilding the storage (`_build`) around the same masters.

State it owns: `pending_plan` (None once placed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from protrain_fx.distributed import check_ranks_agree
from protrain_fx.progress import progress
from protrain_fx.runtime.chunks.common import LOADED_MASTER_ATTR

log = logging.getLogger(__name__)


class PlacementMixin:
    """Where the chunks' values are (module docstring). Part of ChunkManager."""

    def _adopt(self, source: Callable[[nn.Parameter], torch.Tensor]) -> None:
        """Move every parameter's values into its chunk; offloaded parameters keep their shape (on the chunks'
        device), not their storage. Values loaded into a parameter before its chunks were built
        (`protrain_fx.load_state_dict`) come with their fp32 master (LOADED_MASTER_ATTR), which is taken."""
        lo, hi = self._shard_bounds()
        with torch.no_grad():
            pairs = zip(self.params, self.slots)
            for p, slot in progress(pairs, total=len(self.params), desc="parameters into chunks", unit="param"):
                a, b = self._slot_range(slot)
                loaded = p.__dict__.pop(LOADED_MASTER_ATTR, None)
                values = (source(p) if loaded is None else loaded).reshape(-1)
                if slot.chunk < self.n_persist:
                    self.flat[slot.chunk][a:b].copy_(values)
                    if self.master[slot.chunk] is not self.flat[slot.chunk]:
                        self.master[slot.chunk][a:b].copy_(values)
                    p.data = self.flat[slot.chunk][a:b].view(p.shape)
                    continue
                s, e = max(a, lo), min(b, hi)  # this rank's part of the parameter
                if s < e:
                    self.master[slot.chunk][s - lo : e - lo].copy_(values[s - a : e - a])
                if p.device != self.device or p.is_meta:
                    p.data = torch.empty(p.shape, dtype=self.dtype, device=self.device)
                p.untyped_storage().resize_(0)

    def place(self, n_persist: int, n_buffer: int, grad_slots: int | None, device_grad_slots: int | None) -> None:
        """Put a pending manager's chunks where the first compile's plan says: the first `n_persist` chunks' masters
        go to the device (a sharded one gathered from every rank: a collective), their host shards are freed; the
        others keep theirs, pinned now. The values are the masters' as they were, bitwise."""
        assert self.pending_plan is not None, "place() is for a manager built to wait for its plan"
        assert not self.has_grad and not self._pending and not self._in_use, "chunks placed after training started"
        n = self.layout.n_chunk
        if not 0 <= n_persist <= n or (n_persist < n and n_buffer < 1):
            raise ValueError(f"plan n_persist={n_persist}, n_buffer={n_buffer} for {n} chunks")
        old = self.master
        self.n_persist, self.n_buffer = n_persist, (n_buffer if n_persist < n else 0)
        check_ranks_agree(self.layout, self.n_persist, self.n_buffer)
        self._n_reduce_buffers = self._reduce_buffer_count()
        self.pending_plan = None
        self._build(grad_slots, device_grad_slots, masters={c: old[c] for c in range(n_persist, n)})
        with torch.no_grad():
            for c in range(n_persist):
                whole = self.gather_shards(old.pop(c)) if self.world_size > 1 else old.pop(c)
                self.master[c].copy_(whole)
                if self.flat[c] is not self.master[c]:
                    self.flat[c].copy_(whole)
                del whole
                for i in self._chunk_params[c]:
                    a, b = self._slot_range(self.slots[i])
                    self.params[i].data = self.flat[c][a:b].view(self.params[i].shape)
        self._param_versions = self._persistent_versions()
        log.info("chunks placed by the plan: %d of %d persistent, %d buffers", n_persist, n, self.n_buffer)

    @property
    def pending_host_bytes(self) -> int:
        """The host memory a pending manager holds (its masters and gradient shard), which its plan reuses."""
        if self.pending_plan is None:
            return 0
        return sum(m.untyped_storage().nbytes() for m in self.master.values()) + self.arena.numel()
