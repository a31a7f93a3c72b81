"""PlacementMixin: which chunks live on the device, and the parameters' values moved into the chunks.

At construction `_adopt` moves every parameter's values into its chunk (an offloaded parameter keeps its shape on the
chunks' device, not its storage). A manager built by `protrain_fx.prepare` without `n_persist` is pending
(`pending_plan`: the plan fields forced so far): every chunk is offloaded, each master shard in host memory of its
own, until the first compile's plan `place`s the chunks, rebuilding the storage (`_build`) around the same masters.
A trained manager's chunks are placed again by a re-plan (`place_again`, runtime/replan.py), between two steps:
those that change side move with their AdamW states; the others keep their storage.

State it owns: `pending_plan` (None once placed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from protrain_fx import host
from protrain_fx.distributed import check_ranks_agree, most_on_every_rank
from protrain_fx.planner.plan import HOST_STATES
from protrain_fx.profiler.hardware import device_capacity
from protrain_fx.progress import progress
from protrain_fx.runtime.chunks.common import LOADED_MASTER_ATTR
from protrain_fx.runtime.chunks.param_class import set_storage

log = logging.getLogger(__name__)

DEVICE_ROOM_SLACK = 1.2  # what moving chunks up may need beyond their bytes: the allocator's rounding and splits


class PlacementMixin:
    """Where the chunks' values are (module docstring). Part of ChunkManager."""

    def _adopt(self, source: Callable[[nn.Parameter], torch.Tensor]) -> None:
        """Move every parameter's values into its chunk; offloaded parameters keep their shape (on the chunks'
        device), not their storage. Values loaded into a parameter before its chunks were built
        (`protrain_fx.load_state_dict`) come with their fp32 master (LOADED_MASTER_ATTR), which is taken."""
        lo, hi = self.storage.shard_bounds()
        with torch.no_grad():
            pairs = zip(self.params, self.slots)
            for p, slot in progress(pairs, total=len(self.params), desc="parameters into chunks", unit="param"):
                a, b = self.storage.slot_range(slot)
                loaded = p.__dict__.pop(LOADED_MASTER_ATTR, None)
                values = (source(p) if loaded is None else loaded).reshape(-1)
                if slot.chunk < self.n_persist:
                    self.storage.flat[slot.chunk][a:b].copy_(values)
                    if self.storage.master[slot.chunk] is not self.storage.flat[slot.chunk]:
                        self.storage.master[slot.chunk][a:b].copy_(values)
                    set_storage(p, self.storage.flat[slot.chunk][a:b].view(p.shape))
                    continue
                s, e = max(a, lo), min(b, hi)  # this rank's part of the parameter
                if s < e:
                    self.storage.master[slot.chunk][s - lo : e - lo].copy_(values[s - a : e - a])
                if p.device != self.device or p.is_meta:
                    set_storage(p, torch.empty(p.shape, dtype=self.dtype, device=self.device))
                p.untyped_storage().resize_(0)

    def place(self, n_persist: int, n_buffer: int, grad_slots: int | None, device_grad_slots: int | None) -> None:
        """Put a pending manager's chunks where the first compile's plan says: the first `n_persist` chunks' masters
        go to the device (a sharded one gathered from every rank: a collective), their host shards are freed; the
        others keep theirs, pinned now. The values are the masters' as they were, bitwise."""
        assert self.pending_plan is not None, "place() is for a manager built to wait for its plan"
        assert self.step_grads.idle() and not self.host_updates.queued() and not self.gathering.in_use, (
            "chunks placed after training started"
        )
        n = self.layout.n_chunk
        if not 0 <= n_persist <= n or (n_persist < n and n_buffer < 1):
            raise ValueError(f"plan n_persist={n_persist}, n_buffer={n_buffer} for {n} chunks")
        old = self.storage.master
        self.n_buffer = n_buffer if n_persist < n else 0
        check_ranks_agree(self.layout, n_persist, self.n_buffer)
        self.pending_plan = None
        # (the host masters of the chunks that go to the device are freed below, before AdamW makes its states)
        freed = sum(old[c].untyped_storage().nbytes() for c in range(n_persist))
        masters = {c: old[c] for c in range(n_persist, n)}
        self._build(n_persist, grad_slots, device_grad_slots, masters=masters, freed=freed)
        with torch.no_grad():
            for c in range(n_persist):
                whole = self.gather_shards(old.pop(c)) if self.world_size > 1 else old.pop(c)
                self.storage.master[c].copy_(whole)
                if self.storage.flat[c] is not self.storage.master[c]:
                    self.storage.flat[c].copy_(whole)
                del whole
                for i in self._chunk_params[c]:
                    a, b = self.storage.slot_range(self.slots[i])
                    set_storage(self.params[i], self.storage.flat[c][a:b].view(self.params[i].shape))
        self.outside.note_versions()
        log.info("chunks placed by the plan: %d of %d persistent, %d buffers", n_persist, n, self.n_buffer)

    @property
    def between_steps(self) -> bool:
        """No step under way (where `place_again` may move chunks): no gradient held or in flight, no update of
        this step started (the last step's host updates may still run: `place_again` waits for them), no chunk in
        use by a graph, no parameter lent."""
        busy = (self.gathering.in_use, self.outside.lent)
        return self.step_grads.idle() and not any(busy) and not self.step_state.busy

    def place_again(self, n_persist: int, n_buffer: int, grad_slots: int | None, device_grad_slots: int | None) -> bool:
        """Put a trained manager's chunks where a new plan says, between two steps (`between_steps`; every rank
        calls it: collectives). Chunks that become persistent go to the device (a sharded one gathered from every
        rank's shard), those that become offloaded to the host (this rank's shard), each with its masters and AdamW
        states bitwise as they were; the others keep their storage, and the host gradient shards are taken again
        before new ones (what the arena held for them and for the masters of chunks now persistent stays allocated;
        masters pinned on their own are let go). Returns False, with nothing changed on any rank, where a rank's
        host or device has no room for what it adds."""
        n = self.layout.n_chunk
        n_buffer = n_buffer if n_persist < n else 0
        assert self.pending_plan is None and self.between_steps, "chunks placed again during a step"
        if not 0 <= n_persist <= n or (n_persist < n and n_buffer < 1):
            raise ValueError(f"plan n_persist={n_persist}, n_buffer={n_buffer} for {n} chunks")
        check_ranks_agree(self.layout, n_persist, n_buffer)
        self.wait_for_update()
        if self.device.type == "cuda":  # (copies and updates on the side streams are done)
            torch.cuda.synchronize(self.device)
        old = self.n_persist
        up, down = list(range(old, n_persist)), list(range(n_persist, old))
        slots = n - n_persist if grad_slots is None else grad_slots
        room = self._host_room(down, slots) and self._device_room(up)
        if max(most_on_every_rank([0.0 if room else 1.0], self.device)):
            return False
        states = {c: self._chunk_states(c) for c in up + down}  # (a collective where sharded)
        lo, hi = self.storage.shard_bounds()
        with torch.no_grad():
            left = {c: self.storage.master[c] for c in up}
            values = {
                c: self.gather_shards(self.storage.master[c]) if self.storage.is_sharded(c) else self.storage.master[c]
                for c in up
            }
            masters = {c: self.storage.master[c] for c in range(max(old, n_persist), n)}
            masters.update({c: self.storage.master[c][lo:hi].to("cpu", copy=True) for c in down})
        kept = {c: (self.storage.flat[c], self.storage.master[c]) for c in range(min(old, n_persist))}
        reused = list(self.storage.host_grads.owned)
        self._drop_device_storage()
        self.n_buffer = n_buffer
        self._build(n_persist, grad_slots, device_grad_slots, masters=masters, kept=kept, reused=reused)
        with torch.no_grad():
            for c in up:
                self.storage.master[c].copy_(values.pop(c))
                if self.storage.flat[c] is not self.storage.master[c]:
                    self.storage.flat[c].copy_(self.storage.master[c])
                self.storage.unpin(left.pop(c))
        self._repoint_params(up, down)
        for c, (owner, moved) in states.items():
            if owner is not None:
                owner.adopt_chunk_states(self, c, moved)
        log.info("chunks placed again: %d of %d persistent (was %d), %d buffers", n_persist, n, old, self.n_buffer)
        return True

    def _host_room(self, down: list[int], slots: int) -> bool:
        """Whether the host has room for what `place_again` adds: the masters and AdamW states of the chunks it
        offloads, and the gradient shards beyond those it takes again."""
        added = HOST_STATES * len(down) + max(0, slots - len(self.storage.host_grads.owned))
        try:
            host.check_host_memory(
                added * self.layout.shard_elems * self.master_bytes,
                f"the {len(down)} chunks a re-plan offloads",
                f"{self.master_dtype_name} master shards, AdamW states and gradient shards",
                "training goes on under the plan in force",
            )
        except ValueError as error:
            log.warning("the chunks stay where they are: %s", error)
            return False
        return True

    def _device_room(self, up: list[int]) -> bool:
        """Whether the device has room now, beside what it holds between steps, for the chunks `place_again` makes
        persistent: their parameters, masters, AdamW states and gradients, with DEVICE_ROOM_SLACK for the
        allocator. (The CPU's memory is the host's: checked there.)"""
        if self.device.type != "cuda" or not up:
            return True
        torch.cuda.empty_cache()
        capacity = device_capacity(self.device)
        free = capacity - torch.cuda.memory_allocated(self.device)
        master = 0 if self.own_master else self.master_bytes  # (a master apart from the parameters)
        per_elem = self.dtype.itemsize + master + (HOST_STATES - 1) * self.master_bytes + self.master_bytes
        needed = int(len(up) * self.layout.chunk_elems * per_elem * DEVICE_ROOM_SLACK)
        if needed <= free:
            return True
        log.warning(
            "the chunks stay where they are: making %d more persistent needs about %.2f GiB of the device, which has "
            "%.2f GiB free of %.2f GiB between steps",
            len(up),
            needed / 2**30,
            free / 2**30,
            capacity / 2**30,
        )
        return False

    def _chunk_states(self, chunk: int):
        """(its optimizer, its parameters' AdamW states whole) of a chunk about to move; (None, {}) where no
        protrain AdamW steps it."""
        owner = self.owners.of(chunk)
        return (owner, owner.chunk_states(self, chunk)) if owner is not None else (None, {})

    def _drop_device_storage(self) -> None:
        """Let go of what `_build` makes again and holds nothing between steps: the chunk buffers, the landing
        shard, the reduce buffers and the persistent chunks' gradient buffers (so the device holds both plans'
        chunks at once, not their buffers too)."""
        self.gathering.drop()
        self._drop_reduce_storage()
        owners = {id(o): o for c in range(self.layout.n_chunk) if (o := self.owners.of(c)) is not None}
        for owner in owners.values():  # (their inner optimizers' views of the gradient buffers keep them alive)
            owner.let_go_of_grads(self)
        self.storage.drop_grads()

    def _repoint_params(self, up: list[int], down: list[int]) -> None:
        """The parameters of chunks now persistent view their flat chunk; those of chunks now offloaded hold no
        storage (their shape stays, on the chunks' device)."""
        for c in up:
            for i in self._chunk_params[c]:
                a, b = self.storage.slot_range(self.slots[i])
                set_storage(self.params[i], self.storage.flat[c][a:b].view(self.params[i].shape))
        for c in down:
            for i in self._chunk_params[c]:
                p = self.params[i]
                set_storage(p, torch.empty(p.shape, dtype=self.dtype, device=self.device))
                p.untyped_storage().resize_(0)
        self.outside.note_versions()

    @property
    def pending_host_bytes(self) -> int:
        """The host memory a pending manager holds (its masters and gradient shard), which its plan reuses."""
        if self.pending_plan is None:
            return 0
        return self.storage.host_bytes()
