"""StorageMixin: the chunks' memory, and where each parameter sits in it.

State it owns (made by `_build`, again by `place` and `place_again`):
- `flat`: persistent chunk -> its parameters, one flat compute-dtype tensor on the device (the parameters view it);
- `master`: chunk -> its master (persistent: the whole chunk on the device, `flat` itself where the parameters are
  their own master; offloaded: this rank's shard on the host, in `arena` or, for a pending manager, on its own);
- `grad`: chunk -> its gradient of this step (persistent: the whole chunk on the device; offloaded: this rank's
  shard on the host), lent by the two `SlotPool`s `device_grads` and `host_grads` (runtime/chunks/slots.py);
- `arena`: the host memory allocated once at its exact size for the offloaded masters and gradient shards (pinned
  on CUDA, unregistered when the manager is collected); `_pinned`: the master shards pinned on their own (a
  prepared model's, those `place_again` offloads), which `place_again` lets go when it moves them to the device;
- `grad_slots`, `device_grad_slots`: how many gradients the offloaded and the persistent chunks share;
- `_version`: chunk -> the updates published into it (what a gathered copy is checked against).

It also answers where a parameter's elements are (`slot_of`, `param_pieces`, `is_sharded`) and runs the collectives
over whole chunks (`gather_shards`, `all_reduce`). Host memory is checked by `host.check_host_memory`, called
through its module (tests stand in for it there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from protrain_fx import host
from protrain_fx.distributed import across_ranks
from protrain_fx.host import pin_in_place, pinned_arena
from protrain_fx.planner.chunking import Slot
from protrain_fx.planner.plan import HOST_STATES
from protrain_fx.runtime.chunks.common import replaced_param_error
from protrain_fx.runtime.chunks.gather import Gatherer
from protrain_fx.runtime.chunks.slots import SlotPool

log = logging.getLogger(__name__)


class StorageMixin:
    """The chunks' storage (module docstring). Part of ChunkManager."""

    def _init_storage(self) -> None:
        self._version: dict[int, int] = {}  # chunk -> updates published (written by the worker thread)
        # the address of a master shard pinned on its own (not in the arena) -> what unpins and lets it go
        self._pinned: dict[int, object] = {}

    def _build(
        self,
        grad_slots: int | None,
        device_grad_slots: int | None,
        masters: dict[int, torch.Tensor] | None = None,
        *,
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        reused: Sequence[torch.Tensor] = (),
        freed: int = 0,
    ) -> None:
        """The chunks' storage, zero-filled, for `n_persist` and `n_buffer`; `masters`: the offloaded chunks' host
        master shards, already filled (`place`, `place_again`), pinned here where they are not yet. `kept`:
        persistent chunk -> its (flat, master) kept as they are; `reused`: host gradient shards taken again before
        new ones (`place_again`, which checked the host for what it adds); `freed`: host bytes the caller frees
        before training allocates the AdamW states (`place`: the masters of the chunks it moves to the device)."""
        self.flat: dict[int, torch.Tensor] = {}  # persistent: chunk -> device params
        self.master: dict[int, torch.Tensor] = {}  # chunk -> fp32 master (device: whole chunk; host: shard)
        self.grad: dict[int, torch.Tensor] = {}  # chunk -> fp32 gradient (device: whole chunk; host: shard)
        self._build_persistent(kept or {})
        self._build_device_grads(device_grad_slots)
        self._build_host(grad_slots, masters, reused, freed)
        self.gathering = self._new_gatherer()
        self._build_reduce()
        self._build_updates()
        log.info(
            "chunks: %d of %.1f MiB (master %s; %d persistent on %s with %d gradient buffers, %d offloaded, a %.1f "
            "MiB host arena, %d buffers%s)",
            self.layout.n_chunk,
            self.layout.chunk_bytes / 2**20,
            self.master_dtype,
            self.n_persist,
            self.device,
            self.device_grad_slots,
            self.layout.n_chunk - self.n_persist,
            self.arena.numel() / 2**20,
            self.n_buffer,
            "; placed by the first compile's plan" if self.pending_plan is not None else "",
        )

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

    def _build_host(
        self,
        grad_slots: int | None,
        masters: dict[int, torch.Tensor] | None,
        reused: Sequence[torch.Tensor] = (),
        freed: int = 0,
    ) -> None:
        """The offloaded chunks' master shards and gradient shards (`host_grads`: those `reused` first) on the host,
        after checking that the host has room for them and for their AdamW states, counting the `freed` bytes as
        available (unless some are reused: the caller checked what it adds)."""
        shard = self.layout.shard_elems
        offloaded = list(range(self.n_persist, self.layout.n_chunk))
        slots = len(offloaded) if grad_slots is None else grad_slots
        assert 0 < slots <= len(offloaded) or slots == len(offloaded) == 0, f"{slots} gradient shards (make_plan)"
        self.grad_slots = slots
        # (a pending manager holds only the masters; `place` checks for the AdamW states of the chunks it offloads)
        states = 1 if self.pending_plan is not None else HOST_STATES - (1 if masters is not None else 0)
        if not reused:
            host.check_host_memory(
                max(0, shard * self.master_bytes * (states * len(offloaded) + slots) - freed),
                "the offloaded chunks",
                f"{self.master_dtype_name} master shards and AdamW states, and {slots} gradient shards",
                "keep more chunks on the GPU (options={'plan': {'n_persist': ...}}), use more ranks",
            )
        pin = self.device.type == "cuda"
        if masters is None and self.pending_plan is None:  # the masters, then the gradient shards
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
            # (a pending manager's, which no training step uses, is not pinned: pinning would hold it until the
            # manager is collected, and `place` replaces it)
            waits = self.pending_plan is not None
            self.arena = pinned_arena(shard * self.master_bytes * (slots - len(reused)), self, pin=pin and not waits)
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

    def _unpin(self, master: torch.Tensor) -> None:
        """A master shard pinned on its own (`_pinned`) is unregistered and no longer held, where it was."""
        unpin = self._pinned.pop(master.data_ptr(), None)
        if unpin is not None:
            unpin()

    def _drop_grads(self) -> None:
        """Let go of the chunks' gradients and the persistent chunks' gradient buffers (`_build` makes them again)."""
        self.grad = {}
        self.device_grads = None

    def _device_grad_for_step(self, chunk: int) -> torch.Tensor:
        """A persistent chunk's gradient for this step where every shared buffer is held (this step's updates wait
        for `AdamW.step()`, or the chunk's gradient comes in parts): device memory, where the GPU has it."""
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
        offloaded = self.layout.n_chunk - self.n_persist
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
        return self.host_grads.shared

    @property
    def shares_device_grads(self) -> bool:
        """The persistent chunks share fewer fp32 gradient buffers than there are of them (the plan's
        `device_grad_slots`): a chunk holds one from its first gradient of a step until its update has started."""
        return self.device_grads.shared

    def grad_is_shared(self, chunk: int) -> bool:
        """Whether the chunk's gradient is given back after its update (its buffer or shard is shared)."""
        return self.shares_device_grads if chunk < self.n_persist else self.shares_grads

    @property
    def _device_grads(self) -> list[torch.Tensor]:
        """The persistent chunks' own fp32 gradient buffers."""
        return self.device_grads.owned

    @property
    def _free_device_grads(self) -> list[tuple[torch.Tensor, torch.cuda.Event | None]]:
        return self.device_grads.free

    @property
    def _free_grads(self) -> list[tuple[torch.Tensor, torch.cuda.Event | None]]:
        """The host gradient shards no chunk holds now."""
        return self.host_grads.free

    @staticmethod
    def _slot_range(slot: Slot) -> tuple[int, int]:
        return slot.offset, slot.offset + slot.numel

    def _new_gatherer(self) -> Gatherer:
        """The part that loads the offloaded chunks into the plan's `n_buffer` device buffers (gather.py)."""
        offloaded = self.n_persist < self.layout.n_chunk
        return Gatherer(
            self,
            n_buffer=self.n_buffer,
            chunk_elems=self.layout.chunk_elems,
            shard=self.shard_bounds(),
            dtype=self.dtype,
            landing_dtype=None if self.own_master or not offloaded else self.master_dtype,
            device=self.device,
            world_size=self.world_size,
        )

    def master_shard(self, chunk: int) -> torch.Tensor:
        """This rank's master shard of offloaded `chunk` (Gatherer's ChunkSource)."""
        return self.master[chunk]

    def version(self, chunk: int) -> int:
        """How many updates of `chunk` have been published (Gatherer's ChunkSource)."""
        return self._version.get(chunk, 0)

    def shard_bounds(self) -> tuple[int, int]:
        shard = self.layout.shard_elems
        return self.rank * shard, (self.rank + 1) * shard

    def check_params(self, indices: Sequence[int], inputs: Sequence[torch.Tensor]) -> None:
        """The parameters a compiled graph was called with must be the ones in the chunks. (And what was written
        into persistent parameters from outside is taken into their masters, `Outside.take_writes`.)"""
        self.outside.take_writes()
        for i, t in zip(indices, inputs):
            if t is not self.params[i]:
                name = self.slots[i].name
                model = self._model() if self._model is not None else None
                if model is not None and dict(model.named_parameters()).get(name) is self.params[i]:
                    raise ValueError(
                        f"a graph compiled for another model was called with this model's {name!r}: torch.compile "
                        "reuses compiled code across models of one class when their backend is the same object, "
                        "and each model's graphs are rewritten for its own chunks; compile each model with its own "
                        "backend object: torch.compile(model, backend=protrain_fx.ProTrainBackend())"
                    )
                self.check_model_params()  # (a weight tied since says so)
                raise replaced_param_error(name)

    def holds(self, p: nn.Parameter) -> bool:
        """Whether the parameter is in this manager's chunks."""
        return id(p) in self.index

    def holds_no_values(self, p: nn.Parameter) -> bool:
        """Whether the parameter is offloaded and holds no values of its own now (none lent to Python: `lend`)."""
        return self.holds(p) and not self.is_persistent(p) and self.index[id(p)] not in self.outside.lent

    def is_persistent(self, p: nn.Parameter) -> bool:
        return self.slots[self.index[id(p)]].chunk < self.n_persist

    def slot_of(self, p: nn.Parameter) -> Slot:
        return self.slots[self.index[id(p)]]

    def is_sharded(self, chunk: int) -> bool:
        return chunk >= self.n_persist and self.world_size > 1

    def param_pieces(self, chunk: int) -> list[tuple[int, int, int, int]]:
        """(param index, start, end, first element of the parameter) of this rank's pieces of a chunk: `start`
        and `end` in piece coordinates (the whole chunk when persistent, else this rank's shard)."""
        lo, hi = (0, self.layout.chunk_elems) if chunk < self.n_persist else self.shard_bounds()
        pieces = []
        for i, slot in enumerate(self.slots):
            if slot.chunk != chunk:
                continue
            a, b = self._slot_range(slot)
            s, e = max(a, lo), min(b, hi)
            if s < e:
                pieces.append((i, s - lo, e - lo, s - a))
        return pieces

    def gather_shards(self, shard: torch.Tensor) -> torch.Tensor:
        """A chunk-long host tensor from every rank's `shard` (a collective)."""
        parts = [torch.empty_like(shard) for _ in range(self.world_size)]
        with across_ranks("the all-gather of a sharded chunk's optimizer states"):
            if dist.get_backend() == "gloo":
                dist.all_gather(parts, shard)
            else:
                on_device = [t.to(self.device) for t in parts]
                dist.all_gather(on_device, shard.to(self.device))
                parts = [t.cpu() for t in on_device]
        return torch.cat(parts)

    def all_reduce(self, t: torch.Tensor, op, what: str) -> torch.Tensor:
        """`t` reduced over the ranks in place (through the device where the backend needs it)."""
        with across_ranks(what):
            if dist.get_backend() == "gloo" or t.device == self.device:
                dist.all_reduce(t, op=op)
                return t
            on_device = t.to(self.device)
            dist.all_reduce(on_device, op=op)
            return t.copy_(on_device)

    def publish(self, chunk: int) -> None:
        """After an update: a persistent chunk's parameters take the fp32 master's values; an offloaded chunk's
        next gather loads the new master (a buffered copy is stale now). A persistent chunk updated during the
        backward publishes at `end_step` instead."""
        if chunk < self.n_persist and chunk not in self.step_state.early and not self.own_master:
            self.flat[chunk].copy_(self.master[chunk])
        self._version[chunk] = self._version.get(chunk, 0) + 1
