"""ChunkPlacement: which chunks live on the device, and the parameters' values moved into the chunks. A part of the
ChunkManager of its own (`manager.placement`).

At construction `adopt` moves every parameter's values into its chunk (an offloaded parameter keeps its shape on the
chunks' device, not its storage). A manager built by `protrain_fx.prepare` without `n_persist` is pending
(`pending_plan`: the plan fields forced so far): every chunk is offloaded, each master shard in host memory of its
own, until the first compile's plan `place`s the chunks, rebuilding the storage (`PlacedChunks.rebuild`) around the
same masters. A trained manager's chunks are placed again by a re-plan (`place_again`, runtime/replan.py), between two
steps: those that change side move with their AdamW states; the others keep their storage.

State it owns: `pending_plan` (None once placed) and `n_buffer`, the offloaded chunks' device buffers of the
placement. It reads the chunks through the `PlacedChunks` protocol (the manager) and their memory through its
`ChunkStorage`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from protrain_fx import host
from protrain_fx.distributed import check_ranks_agree, most_on_every_rank
from protrain_fx.planner.chunking import ChunkLayout, Slot
from protrain_fx.planner.plan import HOST_STATES
from protrain_fx.profiler.hardware import device_capacity
from protrain_fx.progress import progress
from protrain_fx.runtime.chunks.common import LOADED_MASTER_ATTR
from protrain_fx.runtime.chunks.gather import Gatherer
from protrain_fx.runtime.chunks.host_updates import HostUpdates
from protrain_fx.runtime.chunks.outside import Outside
from protrain_fx.runtime.chunks.owners import Owners
from protrain_fx.runtime.chunks.param_class import set_storage
from protrain_fx.runtime.chunks.step_grads import StepGrads
from protrain_fx.runtime.chunks.step_state import StepState
from protrain_fx.runtime.chunks.storage import ChunkStorage

log = logging.getLogger(__name__)

DEVICE_ROOM_SLACK = 1.2  # what moving chunks up may need beyond their bytes: the allocator's rounding and splits


class PlacedChunks(Protocol):
    """What a ChunkPlacement reads of the chunks (the ChunkManager), and asks of it."""

    storage: ChunkStorage
    layout: ChunkLayout
    params: list[nn.Parameter]
    slots: list[Slot]
    _chunk_params: dict[int, list[int]]  # chunk -> its parameters' indices
    device: torch.device
    dtype: torch.dtype
    world_size: int
    gathering: Gatherer
    outside: Outside
    owners: Owners
    step_grads: StepGrads
    step_state: StepState
    host_updates: HostUpdates

    def rebuild(
        self,
        n_persist: int,
        grad_slots: int | None,
        device_grad_slots: int | None,
        masters: dict[int, torch.Tensor] | None = None,
        *,
        n_device_shard: int = 0,
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        reused: Sequence[torch.Tensor] = (),
        freed: int = 0,
    ) -> None:
        """The storage for `n_persist` persistent chunks, and the parts built around it."""
        ...

    def drop_buffers(self) -> None:
        """Let go of the buffers the parts built around the storage hold (gathering's, reducing's)."""
        ...

    def wait_for_update(self, chunk: int | None = None) -> None: ...

    def gather_shards(self, shard: torch.Tensor) -> torch.Tensor: ...


class ChunkPlacement:
    """Where the chunks' values are (module docstring)."""

    def __init__(self, chunks: PlacedChunks, n_buffer: int, pending_plan: Mapping[str, Any] | None):
        self.chunks = chunks
        self.n_buffer = n_buffer
        self.pending_plan = dict(pending_plan) if pending_plan is not None else None

    def adopt(self, source: Callable[[nn.Parameter], torch.Tensor]) -> None:
        """Move every parameter's values into its chunk; offloaded parameters keep their shape (on the chunks'
        device), not their storage. Values loaded into a parameter before its chunks were built
        (`protrain_fx.load_state_dict`) come with their fp32 master (LOADED_MASTER_ATTR), which is taken."""
        c, storage = self.chunks, self.chunks.storage
        lo, hi = storage.shard_bounds()
        with torch.no_grad():
            pairs = zip(c.params, c.slots)
            for p, slot in progress(pairs, total=len(c.params), desc="parameters into chunks", unit="param"):
                a, b = storage.slot_range(slot)
                loaded = p.__dict__.pop(LOADED_MASTER_ATTR, None)
                values = (source(p) if loaded is None else loaded).reshape(-1)
                if slot.chunk < storage.n_persist:
                    storage.flat[slot.chunk][a:b].copy_(values)
                    if storage.master[slot.chunk] is not storage.flat[slot.chunk]:
                        storage.master[slot.chunk][a:b].copy_(values)
                    set_storage(p, storage.flat[slot.chunk][a:b].view(p.shape))
                    continue
                s, e = max(a, lo), min(b, hi)  # this rank's part of the parameter
                if s < e:
                    storage.master[slot.chunk][s - lo : e - lo].copy_(values[s - a : e - a])
                if p.device != c.device or p.is_meta:
                    set_storage(p, torch.empty(p.shape, dtype=c.dtype, device=c.device))
                p.untyped_storage().resize_(0)

    def place(
        self,
        n_persist: int,
        n_buffer: int,
        grad_slots: int | None,
        device_grad_slots: int | None,
        n_device_shard: int = 0,
    ) -> None:
        """Put a pending manager's chunks where the first compile's plan says: the first `n_persist` chunks' masters
        go to the device (a sharded one gathered from every rank: a collective), and the next `n_device_shard`'s
        shards, their host shards freed; the others keep theirs, pinned now. The values are the masters' as they
        were, bitwise."""
        c, storage = self.chunks, self.chunks.storage
        assert self.pending_plan is not None, "place() is for a manager built to wait for its plan"
        assert c.step_grads.idle() and not c.host_updates.queued() and not c.gathering.in_use, (
            "chunks placed after training started"
        )
        n = c.layout.n_chunk
        check_places(n, n_persist, n_buffer, n_device_shard)
        old = storage.master
        self.n_buffer = n_buffer if n_persist < n else 0
        check_ranks_agree(c.layout, n_persist, self.n_buffer, n_device_shard)
        self.pending_plan = None
        # (the host masters of the chunks that go to the device are freed below, before AdamW makes its states)
        freed = sum(old[i].untyped_storage().nbytes() for i in range(n_persist + n_device_shard))
        masters = {i: old[i] for i in range(n_persist, n)}
        masters.update({i: old[i].to(c.device, copy=True) for i in range(n_persist, n_persist + n_device_shard)})
        c.rebuild(n_persist, grad_slots, device_grad_slots, masters=masters, n_device_shard=n_device_shard, freed=freed)
        with torch.no_grad():
            for chunk in range(n_persist):
                whole = c.gather_shards(old.pop(chunk)) if c.world_size > 1 else old.pop(chunk)
                storage.master[chunk].copy_(whole)
                if storage.flat[chunk] is not storage.master[chunk]:
                    storage.flat[chunk].copy_(whole)
                del whole
        self._repoint_params(list(range(n_persist)), [])
        log.info(
            "chunks placed by the plan: %d of %d persistent, %d sharded on the device, %d buffers",
            n_persist,
            n,
            n_device_shard,
            self.n_buffer,
        )

    @property
    def between_steps(self) -> bool:
        """No step under way (where `place_again` may move chunks): no gradient held or in flight, no update of
        this step started (the last step's host updates may still run: `place_again` waits for them), no chunk in
        use by a graph, no parameter lent."""
        c = self.chunks
        busy = (c.gathering.in_use, c.outside.lent)
        return c.step_grads.idle() and not any(busy) and not c.step_state.busy

    def place_again(
        self,
        n_persist: int,
        n_buffer: int,
        grad_slots: int | None,
        device_grad_slots: int | None,
        n_device_shard: int = 0,
    ) -> bool:
        """Put a trained manager's chunks where a new plan says, between two steps (`between_steps`; every rank
        calls it: collectives). Chunks that become persistent go to the device (a sharded one gathered from every
        rank's shard), those that become sharded keep this rank's shard, on the device or the host as the plan
        says; each moves with its masters and AdamW states bitwise as they were; the others keep their storage,
        and the host gradient shards are taken again before new ones (what the arena held for them and for the
        masters of chunks now on the device stays allocated; masters pinned on their own are let go). Returns
        False, with nothing changed on any rank, where a rank's host or device has no room for what it adds."""
        c, storage = self.chunks, self.chunks.storage
        n = c.layout.n_chunk
        n_buffer = n_buffer if n_persist < n else 0
        assert self.pending_plan is None and self.between_steps, "chunks placed again during a step"
        check_places(n, n_persist, n_buffer, n_device_shard)
        check_ranks_agree(c.layout, n_persist, n_buffer, n_device_shard)
        c.wait_for_update()
        if c.device.type == "cuda":  # (copies and updates on the side streams are done)
            torch.cuda.synchronize(c.device)
        was = [_place_of(i, storage.n_persist, storage.n_device_shard) for i in range(n)]
        now = [_place_of(i, n_persist, n_device_shard) for i in range(n)]
        moved = [i for i in range(n) if was[i] != now[i]]
        up = [i for i in moved if now[i] == PERSISTENT]
        down = [i for i in moved if was[i] == PERSISTENT]
        to_host = [i for i in moved if now[i] == HOST]
        slots = n - n_persist - n_device_shard if grad_slots is None else grad_slots
        to_shard = [i for i in moved if now[i] == DEVICE_SHARD]
        room = self._host_room(to_host, slots) and self._device_room(up, to_shard)
        if max(most_on_every_rank([0.0 if room else 1.0], c.device)):
            return False
        states = {chunk: self._chunk_states(chunk) for chunk in moved}  # (a collective where sharded)
        left = {i: storage.master[i] for i in moved if was[i] != PERSISTENT}
        with torch.no_grad():
            values = {i: c.gather_shards(storage.master[i]) if storage.is_sharded(i) else storage.master[i] for i in up}
            masters = self._masters_going(was, now)
        kept = {i: (storage.flat[i], storage.master[i]) for i in range(n) if was[i] == now[i] == PERSISTENT}
        assert storage.host_grads is not None, "place_again before the chunks were built"
        reused = list(storage.host_grads.owned)
        old = (storage.n_persist, storage.n_device_shard)
        self._drop_device_storage()
        self.n_buffer = n_buffer
        c.rebuild(
            n_persist, grad_slots, device_grad_slots, masters, n_device_shard=n_device_shard, kept=kept, reused=reused
        )
        with torch.no_grad():
            for chunk in up:
                storage.master[chunk].copy_(values.pop(chunk))
                if storage.flat[chunk] is not storage.master[chunk]:
                    storage.flat[chunk].copy_(storage.master[chunk])
        for chunk, master in left.items():
            if now[chunk] != HOST:
                storage.unpin(master)
        self._repoint_params(up, down)
        for chunk, (owner, moved_states) in states.items():
            if owner is not None:
                owner.adopt_chunk_states(c, chunk, moved_states)
        log.info(
            "chunks placed again: %d of %d persistent, %d sharded on the device (were %d, %d), %d buffers",
            *(n_persist, n, n_device_shard, *old, self.n_buffer),
        )
        return True

    def _masters_going(self, was: list[str], now: list[str]) -> dict[int, torch.Tensor]:
        """Each chunk's master shard where `now` shards it (`was`, `now`: each chunk's place before and after): a
        persistent chunk's slice for this rank, and a shard that changes side, copied to the device or the host."""
        c, storage = self.chunks, self.chunks.storage
        lo, hi = storage.shard_bounds()
        target = {HOST: torch.device("cpu"), DEVICE_SHARD: c.device}
        masters = {}
        for i, place in enumerate(now):
            if place == PERSISTENT:
                continue
            master = storage.master[i][lo:hi] if was[i] == PERSISTENT else storage.master[i]
            masters[i] = master if was[i] == place else master.to(target[place], copy=True)
        return masters

    def _host_room(self, to_host: list[int], slots: int) -> bool:
        """Whether the host has room for what `place_again` adds: the masters and AdamW states of the chunks it
        offloads, and the gradient shards beyond those it takes again."""
        storage = self.chunks.storage
        owned = len(storage.host_grads.owned) if storage.host_grads is not None else 0
        added = HOST_STATES * len(to_host) + max(0, slots - owned)
        try:
            host.check_host_memory(
                added * self.chunks.layout.shard_elems * storage.master_bytes,
                f"the {len(to_host)} chunks a re-plan offloads",
                f"{storage.master_dtype_name} master shards, AdamW states and gradient shards",
                "training goes on under the plan in force",
            )
        except ValueError as error:
            log.warning("the chunks stay where they are: %s", error)
            return False
        return True

    def _device_room(self, up: list[int], to_shard: list[int]) -> bool:
        """Whether the device has room now, beside what it holds between steps, for the chunks `place_again` makes
        persistent (`up`: their parameters, masters, AdamW states and gradients) or shards there (`to_shard`: this
        rank's shard of master, AdamW states and gradient), with DEVICE_ROOM_SLACK for the allocator. (The CPU's
        memory is the host's: checked there.)"""
        c, storage = self.chunks, self.chunks.storage
        if c.device.type != "cuda" or not (up or to_shard):
            return True
        torch.cuda.empty_cache()
        capacity = device_capacity(c.device)
        assert capacity is not None, f"no capacity known for {c.device}"
        free = capacity - torch.cuda.memory_allocated(c.device)
        master = 0 if storage.own_master else storage.master_bytes  # (a master apart from the parameters)
        per_elem = c.dtype.itemsize + master + (HOST_STATES - 1) * storage.master_bytes + storage.master_bytes
        shards = len(to_shard) * c.layout.shard_elems * (HOST_STATES + 1) * storage.master_bytes
        needed = int((len(up) * c.layout.chunk_elems * per_elem + shards) * DEVICE_ROOM_SLACK)
        if needed <= free:
            return True
        log.warning(
            "the chunks stay where they are: making %d more persistent and sharding %d more there needs about %.2f GiB "
            "of the device, which has %.2f GiB free of %.2f GiB between steps",
            len(up),
            len(to_shard),
            needed / 2**30,
            free / 2**30,
            capacity / 2**30,
        )
        return False

    def _chunk_states(self, chunk: int) -> tuple[Any, dict]:
        """(its optimizer, its parameters' AdamW states whole) of a chunk about to move; (None, {}) where no
        protrain AdamW steps it."""
        owner = self.chunks.owners.of(chunk)
        return (owner, owner.chunk_states(self.chunks, chunk)) if owner is not None else (None, {})

    def _drop_device_storage(self) -> None:
        """Let go of what `rebuild` makes again and holds nothing between steps: the chunk buffers, the landing
        shard, the reduce buffers and the persistent chunks' gradient buffers (so the device holds both plans'
        chunks at once, not their buffers too)."""
        c = self.chunks
        c.drop_buffers()
        owners = {id(o): o for i in range(c.layout.n_chunk) if (o := c.owners.of(i)) is not None}
        for owner in owners.values():  # (their inner optimizers' views of the gradient buffers keep them alive)
            owner.let_go_of_grads(c)
        c.storage.drop_grads()

    def _repoint_params(self, up: list[int], down: list[int]) -> None:
        """The parameters of chunks now persistent view their flat chunk; those of chunks persistent no more hold no
        storage (their shape stays, on the chunks' device)."""
        c, storage = self.chunks, self.chunks.storage
        for chunk in up:
            for i in c._chunk_params[chunk]:
                a, b = storage.slot_range(c.slots[i])
                set_storage(c.params[i], storage.flat[chunk][a:b].view(c.params[i].shape))
        for chunk in down:
            for i in c._chunk_params[chunk]:
                p = c.params[i]
                set_storage(p, torch.empty(p.shape, dtype=c.dtype, device=c.device))
                p.untyped_storage().resize_(0)
        c.outside.note_versions()

    @property
    def pending_host_bytes(self) -> int:
        """The host memory a pending manager holds (its masters and gradient shard), which its plan reuses."""
        return 0 if self.pending_plan is None else self.chunks.storage.host_bytes()


# where a chunk is: whole on the device, sharded across the ranks on the device, or sharded on the host
PERSISTENT, DEVICE_SHARD, HOST = "persistent", "device shard", "host"


def _place_of(chunk: int, n_persist: int, n_device_shard: int) -> str:
    return PERSISTENT if chunk < n_persist else DEVICE_SHARD if chunk < n_persist + n_device_shard else HOST


def check_places(n: int, n_persist: int, n_buffer: int, n_device_shard: int = 0) -> None:
    """A ValueError where the plan's places do not suit `n` chunks."""
    if not 0 <= n_persist <= n:
        raise ValueError(f"plan n_persist={n_persist} must be between 0 and the {n} chunks")
    if not 0 <= n_device_shard <= n - n_persist:
        raise ValueError(
            f"plan n_device_shard={n_device_shard} must be between 0 and the {n - n_persist} chunks after the "
            f"n_persist={n_persist} persistent ones"
        )
    if n_persist < n and n_buffer < 1:
        raise ValueError(f"plan n_buffer={n_buffer}: non-persistent chunks need at least 1 buffer")
