"""ChunkStorage: the chunks' memory, and where each chunk's elements are in it. A part of the ChunkManager of its own
(`manager.storage`), built again by each placement (`build`).

State it owns:
- `flat`: persistent chunk -> its parameters, one flat compute-dtype tensor on the device (the parameters view it);
- `master`: chunk -> its master (persistent: the whole chunk on the device, `flat` itself where the parameters are
  their own master; sharded on the device: this rank's shard on the device; offloaded: this rank's shard on the
  host, in `arena` or, for a pending manager, on its own);
- `grad`: chunk -> its gradient of this step (persistent: the whole chunk on the device; sharded on the device: this
  rank's shard there; offloaded: this rank's shard on the host), lent by the `SlotPool`s `device_grads`,
  `shard_grads` (one each) and `host_grads` (runtime/chunks/slots.py);
- `arena`: the host memory allocated once at its exact size for the offloaded masters and gradient shards (pinned
  on CUDA, unregistered when the storage is collected); `_pinned`: the master shards pinned on their own (a
  prepared model's, those `place_again` offloads), let go by `unpin` when they move to the device;
- `grad_slots`, `device_grad_slots`: how many gradients the offloaded and the persistent chunks share;
- `versions`: chunk -> the updates published into it (what a gathered copy is checked against);
- `n_persist`: the persistent chunks of the placement built (the first ones); `n_device_shard`: the chunks after
  them sharded across the ranks on the device (gathered like offloaded ones, updated on the device); the rest are
  offloaded.

Host memory is checked by `host.check_host_memory`, called through its module (tests stand in for it there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from protrain_fx import host
from protrain_fx.host import pin_in_place, pinned_arena
from protrain_fx.planner.chunking import ChunkLayout, Slot
from protrain_fx.planner.plan import HOST_STATES
from protrain_fx.runtime.chunks.slots import SlotPool

log = logging.getLogger(__name__)


class ChunkStorage:
    """The chunks' memory (module docstring)."""

    def __init__(
        self,
        layout: ChunkLayout,
        *,
        n_persist: int,
        dtype: torch.dtype,
        master_dtype_name: str,
        device: torch.device,
        rank: int,
        world_size: int,
        wait_for_a_give_back: Callable[[], bool],
    ):
        """`n_persist`: the persistent chunks until `build` places them; `dtype`: the parameters'; `master_dtype_name`: the plan's master dtype; `rank` of `world_size`: this
        rank's shard of an offloaded chunk; `wait_for_a_give_back()`: wait for a queued host update that gives a
        gradient shard back (False where none is queued)."""
        self.layout = layout
        self.dtype = dtype
        self.master_dtype_name = master_dtype_name
        self.master_dtype: torch.dtype = getattr(torch, master_dtype_name)
        self.master_bytes = self.master_dtype.itemsize
        self.own_master = dtype == self.master_dtype  # (the parameters are their own master)
        self.device = device
        self.rank, self.world_size = rank, world_size
        self._wait_for_a_give_back = wait_for_a_give_back
        self.versions: dict[int, int] = {}  # chunk -> updates published (written by the worker thread)
        # the address of a master shard pinned on its own (not in the arena) -> what unpins and lets it go
        self._pinned: dict[int, Callable[[], None]] = {}
        self.n_persist = n_persist
        self.n_device_shard = 0
        self.flat: dict[int, torch.Tensor] = {}
        self.master: dict[int, torch.Tensor] = {}
        self.grad: dict[int, torch.Tensor] = {}
        self.arena = torch.empty(0, dtype=torch.uint8)
        self.grad_slots = self.device_grad_slots = 0
        self.device_grads: SlotPool | None = None
        self.shard_grads: SlotPool | None = None
        self.host_grads: SlotPool | None = None

    def build(
        self,
        n_persist: int,
        grad_slots: int | None,
        device_grad_slots: int | None,
        masters: dict[int, torch.Tensor] | None = None,
        *,
        n_device_shard: int = 0,
        pending: bool = False,
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        reused: Sequence[torch.Tensor] = (),
        freed: int = 0,
    ) -> None:
        """The storage of `n_persist` persistent chunks and `n_device_shard` sharded on the device, zero-filled;
        `masters`: the sharded chunks' master shards, already filled (`place`, `place_again`; on the device for a
        chunk sharded there), those on the host pinned here where they are not yet. `pending`: the chunks
        wait for their plan (every one offloaded; its master shards on their own, unpinned). `kept`: persistent
        chunk -> its (flat, master) kept as they are; `reused`: host gradient shards taken again before new ones
        (`place_again`, which checked the host for what it adds); `freed`: host bytes the caller frees before
        training allocates the AdamW states (`place`: the masters of the chunks it moves to the device)."""
        assert 0 <= n_device_shard <= self.layout.n_chunk - n_persist and not (pending and n_device_shard), (
            f"{n_device_shard} chunks sharded on the device (make_plan)"
        )
        self.n_persist, self.n_device_shard = n_persist, n_device_shard
        self.flat, self.master, self.grad = {}, {}, {}
        self._build_persistent(kept or {})
        self._build_device_grads(device_grad_slots)
        self._build_device_shards(masters)
        self._build_host(grad_slots, masters, pending, reused, freed)

    def _build_persistent(self, kept: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The persistent chunks' parameters and masters on the device (those `kept` as they are)."""
        elems = self.layout.chunk_elems
        for c in range(self.n_persist):
            if c in kept:
                self.flat[c], self.master[c] = kept[c]
                continue
            self.flat[c] = torch.zeros(elems, dtype=self.dtype, device=self.device)
            self.master[c] = (
                self.flat[c] if self.own_master else torch.zeros(elems, dtype=self.master_dtype, device=self.device)
            )

    def _build_device_grads(self, device_grad_slots: int | None) -> None:
        """The persistent chunks' fp32 gradients: one each, or fewer, shared in turn (`device_grads`)."""
        device_slots = self.n_persist if device_grad_slots is None else device_grad_slots
        assert 0 < device_slots <= self.n_persist or device_slots == self.n_persist == 0, (
            f"{device_slots} device gradient buffers (make_plan)"
        )
        self.device_grad_slots = device_slots
        owned = [
            torch.zeros(self.layout.chunk_elems, dtype=self.master_dtype, device=self.device)
            for _ in range(device_slots)
        ]
        self.device_grads = SlotPool(
            owned, range(self.n_persist), self.grad, device=self.device, for_step=self._device_grad_for_step
        )

    def _build_device_shards(self, masters: dict[int, torch.Tensor] | None) -> None:
        """The chunks sharded on the device: this rank's master shard (that of `masters` where given, on the device)
        and its gradient shard, one each (`shard_grads`)."""
        shard = self.layout.shard_elems
        chunks = self.device_sharded()
        for c in chunks:
            given = masters[c] if masters is not None else None
            if given is None:
                self.master[c] = torch.zeros(shard, dtype=self.master_dtype, device=self.device)
            else:
                assert given.device == self.device, f"chunk {c}'s master shard given on {given.device}"
                self.master[c] = given
        owned = [torch.zeros(shard, dtype=self.master_dtype, device=self.device) for _ in chunks]
        self.shard_grads = SlotPool(owned, chunks, self.grad, device=self.device, for_step=self._device_grad_for_step)

    def device_sharded(self) -> range:
        """The chunks sharded across the ranks on the device."""
        return range(self.n_persist, self.n_persist + self.n_device_shard)

    def offloaded(self) -> range:
        """The chunks sharded across the ranks on the host (updated by the host AdamW)."""
        return range(self.n_persist + self.n_device_shard, self.layout.n_chunk)

    def on_host(self, chunk: int) -> bool:
        """Whether `chunk` is offloaded: its master shard on the host, updated by the host AdamW."""
        return chunk >= self.n_persist + self.n_device_shard

    def grads_of(self, chunk: int) -> SlotPool:
        """The pool that lends `chunk` its gradient."""
        if chunk < self.n_persist:
            pool = self.device_grads
        else:
            pool = self.host_grads if self.on_host(chunk) else self.shard_grads
        assert pool is not None, f"chunk {chunk}'s gradients are let go (drop_grads)"
        return pool

    def _build_host(
        self,
        grad_slots: int | None,
        masters: dict[int, torch.Tensor] | None,
        pending: bool,
        reused: Sequence[torch.Tensor] = (),
        freed: int = 0,
    ) -> None:
        """The offloaded chunks' master shards and gradient shards (`host_grads`: those `reused` first) on the host,
        after checking that the host has room for them and for their AdamW states, counting the `freed` bytes as
        available (unless some are reused: the caller checked what it adds)."""
        shard = self.layout.shard_elems
        offloaded = list(self.offloaded())
        slots = len(offloaded) if grad_slots is None else grad_slots
        assert 0 < slots <= len(offloaded) or slots == len(offloaded) == 0, f"{slots} gradient shards (make_plan)"
        self.grad_slots = slots
        # (a pending storage holds only the masters; `place` checks for the AdamW states of the chunks it offloads)
        states = 1 if pending else HOST_STATES - (1 if masters is not None else 0)
        if not reused:
            host.check_host_memory(
                max(0, shard * self.master_bytes * (states * len(offloaded) + slots) - freed),
                "the offloaded chunks",
                f"{self.master_dtype_name} master shards and AdamW states, and {slots} gradient shards",
                "keep more chunks on the GPU (options={'plan': {'n_persist': ...}}), use more ranks",
            )
        pin = self.device.type == "cuda"
        if masters is None and not pending:  # the masters, then the gradient shards
            self.arena = pinned_arena(shard * self.master_bytes * (len(offloaded) + slots), self, pin=pin)
            parts = self.arena.view(self.master_dtype).split(shard) if offloaded else ()
            self.master.update(zip(offloaded, parts))
            parts = parts[len(offloaded) :]
        else:  # each master on its own, so that `place` frees those of the chunks it puts on the device
            for c in offloaded:
                self.master[c] = masters[c] if masters is not None else torch.empty(shard, dtype=self.master_dtype)
                if masters is not None and pin and not self.master[c].is_pinned():  # (kept by `place_again`)
                    self._pinned[self.master[c].data_ptr()] = pin_in_place(self.master[c], self)
            reused = list(reused[:slots])
            # (a pending storage's, which no training step uses, is not pinned: pinning would hold it until the
            # storage is collected, and `place` replaces it)
            self.arena = pinned_arena(shard * self.master_bytes * (slots - len(reused)), self, pin=pin and not pending)
            parts = [*reused, *(self.arena.view(self.master_dtype).split(shard) if slots > len(reused) else ())]
            if masters is None:
                for c in offloaded:
                    self.master[c].zero_()
        self.arena.zero_()
        self.host_grads = SlotPool(
            list(parts),
            offloaded,
            self.grad,
            device=torch.device("cpu"),
            for_step=self._host_grad_for_step,
            wait_for_one=self._wait_for_a_give_back,
        )

    def unpin(self, master: torch.Tensor) -> None:
        """A master shard pinned on its own (`_pinned`) is unregistered and no longer held, where it was."""
        unpin = self._pinned.pop(master.data_ptr(), None)
        if unpin is not None:
            unpin()

    def drop_grads(self) -> None:
        """Let go of the chunks' gradients and the device gradient buffers and shards (`build` makes them again)."""
        self.grad = {}
        self.device_grads = self.shard_grads = None

    def _device_grad_for_step(self, chunk: int) -> torch.Tensor:
        """A persistent chunk's gradient for this step where every shared buffer is held (this step's updates wait
        for `AdamW.step()`, or the chunk's gradient comes in parts): device memory, where the GPU has it. (A chunk
        sharded on the device holds its own shard: never called for it.)"""
        assert chunk < self.n_persist, f"chunk {chunk} holds its own gradient shard on the device"
        try:
            return torch.empty(self.layout.chunk_elems, dtype=self.master_dtype, device=self.device)
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(
                f"chunk {chunk}'s gradients need a {self.master_dtype_name} gradient buffer of "
                f"{self.layout.chunk_elems * self.master_bytes / 2**30:.2f} GiB on {self.device}: the plan "
                f"shares {self.device_grad_slots} among the {self.n_persist} persistent chunks (no plan with "
                "one each fits this machine), and this step holds them all: its updates wait for "
                "optimizer.step() (gradient clipping, accumulation, float16 loss scaling, nonfinite='skip', "
                "a resumed model's first step), or its gradients come from several compiled graphs. Train "
                "without clipping or gradient accumulation, or a smaller model or batch, or on more GPUs"
            ) from e

    def _host_grad_for_step(self, chunk: int) -> torch.Tensor:
        """An offloaded chunk's gradient shard for this step where every shared one is held and no pending update
        gives one back (this step's updates wait for `AdamW.step()`): plain host memory, where the host has it."""
        offloaded = len(self.offloaded())
        host.check_host_memory(
            self.layout.shard_elems * self.master_bytes,
            f"chunk {chunk}'s gradients",
            f"a {self.master_dtype_name} gradient shard; the plan shares {self.grad_slots} among the {offloaded} "
            "offloaded chunks, and this step holds them all: its host updates wait for optimizer.step() (gradient "
            "clipping, accumulation, float16 loss scaling, or a resumed model's first step)",
            "train without clipping or gradient accumulation, or give the plan more host memory",
        )
        return torch.empty(self.layout.shard_elems, dtype=self.master_dtype)

    @property
    def shares_grads(self) -> bool:
        """The offloaded chunks share fewer host gradient shards than there are of them (the plan's
        `host_grad_slots`): a chunk holds one from its first gradient of a step until its update has run."""
        assert self.host_grads is not None, "the chunks' storage is not built"
        return self.host_grads.shared

    @property
    def shares_device_grads(self) -> bool:
        """The persistent chunks share fewer fp32 gradient buffers than there are of them (the plan's
        `device_grad_slots`): a chunk holds one from its first gradient of a step until its update has started."""
        assert self.device_grads is not None, "the persistent chunks' gradient buffers are let go (drop_grads)"
        return self.device_grads.shared

    def grad_is_shared(self, chunk: int) -> bool:
        """Whether the chunk's gradient is given back after its update (its buffer or shard is shared)."""
        return self.grads_of(chunk).shared

    def master_shard(self, chunk: int) -> torch.Tensor:
        """This rank's master shard of sharded `chunk`, on the device or the host (Gatherer's ChunkSource)."""
        return self.master[chunk]

    def version(self, chunk: int) -> int:
        """How many updates of `chunk` have been published (Gatherer's ChunkSource)."""
        return self.versions.get(chunk, 0)

    def published(self, chunk: int) -> None:
        """An update of `chunk` is published: a gathered copy of it is stale now."""
        self.versions[chunk] = self.versions.get(chunk, 0) + 1

    def shard_bounds(self) -> tuple[int, int]:
        """This rank's elements of a sharded chunk."""
        shard = self.layout.shard_elems
        return self.rank * shard, (self.rank + 1) * shard

    def is_sharded(self, chunk: int) -> bool:
        return chunk >= self.n_persist and self.world_size > 1

    @staticmethod
    def slot_range(slot: Slot) -> tuple[int, int]:
        return slot.offset, slot.offset + slot.numel

    def param_pieces(self, chunk: int) -> list[tuple[int, int, int, int]]:
        """(param index, start, end, first element of the parameter) of this rank's pieces of a chunk: `start`
        and `end` in piece coordinates (the whole chunk when persistent, else this rank's shard)."""
        lo, hi = (0, self.layout.chunk_elems) if chunk < self.n_persist else self.shard_bounds()
        pieces = []
        for i, slot in enumerate(self.layout.slots):
            if slot.chunk != chunk:
                continue
            a, b = self.slot_range(slot)
            s, e = max(a, lo), min(b, hi)
            if s < e:
                pieces.append((i, s - lo, e - lo, s - a))
        return pieces

    def host_bytes(self) -> int:
        """The host memory the masters held on their own and the arena take."""
        return sum(m.untyped_storage().nbytes() for m in self.master.values()) + self.arena.numel()
