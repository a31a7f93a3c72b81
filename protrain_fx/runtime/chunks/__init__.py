"""ChunkManager: owns the parameters, gradients and optimizer states of one model, in chunks (paper §3.1).

Layout (planner/chunking.py) decides which parameter is where; the plan decides `n_persist`, `n_device_shard`
and `n_buffer`. Then:

- the master dtype (the plan's `master_dtype`): what the master weights, gradients and AdamW states are kept in.
  float32 by default, below; with "bfloat16" on a bfloat16 model the parameters are their own master and
  gradients and states are bfloat16 (what `torch.optim.AdamW` over a bfloat16 model keeps), as a float32
  model's parameters are. "fp32" below is the master dtype.
- persistent chunks (the first `n_persist`): the chunk's parameters are views of one flat device tensor
  (compute dtype), with an fp32 master copy, an fp32 gradient and AdamW states on the device, updated by
  torch's fused AdamW as soon as the chunk's gradient is final, on a stream beside the rest of the backward
  (the parameters take the new master after the backward; parameters that are their own master change as
  soon as the backward has read them for the last time). Gradients are all-reduced across ranks. Where the
  plan's `device_grad_slots` is below `n_persist` (no plan with a gradient each fits the machine), the
  persistent chunks share that many fp32 gradients: a chunk takes one at its first gradient of the step and
  gives it back once its update is queued; a step whose updates wait for `AdamW.step()` takes those it lacks
  from the allocator for the step.
- chunks sharded on the device (the plan's `n_device_shard`, after the persistent ones; several ranks): each rank
  holds its shard's fp32 master, gradient and AdamW states on the device; gathered as offloaded chunks are
  (below, with no copy from the host), reduce-scattered into the shard's gradient there, and updated on the device
  as persistent chunks are (ZeRO-3 on the device; storage.py).
- offloaded chunks (the rest): each rank holds its shard (fp32 master, fp32 gradient) in one host arena allocated
  once at its exact size (host.py: pinned with `cudaHostRegister` on CUDA, not the power-of-two host
  allocator; unregistered when the manager is collected). The parameters' own storage is emptied
  (`resize_(0)`): the compiled graphs read them through `gather`, which copies this rank's fp32 master shard
  to the device, casts it into one of `n_buffer` compute-dtype buffers and all-gathers the rest. (Casting on
  the device costs PCIe bytes, which overlap compute, instead of a host cast after every update, which would
  lengthen the host optimizer, the usual bottleneck of offloading.) `release` makes the buffer reusable; a
  chunk still in a buffer when gathered again (backward right after forward) is not copied again, and
  `prefetch` loads the next chunk on a copy stream. Gradients are reduce-scattered in fp32 and copied
  straight into the shard's fp32 gradient without blocking (into a staging shard and added, when a chunk gets
  a second gradient in one step), and a worker thread runs the CPU AdamW step of that shard (torch's fused
  CPU kernel) as soon as the copy lands, overlapping the rest of the backward.
- gradient shards on the host: one per offloaded chunk where the host has room, else the plan's
  `host_grad_slots` (at least MIN_GRAD_SLOTS), which the offloaded chunks share: a chunk takes one when its
  first gradient of the step arrives and gives it back once its host update has run, and the backward waits
  for the host where all are taken. A step whose host updates wait for `AdamW.step()` (the first step,
  clipping, accumulation, float16) holds every offloaded gradient at once: the shards it lacks are plain host
  memory taken for that step and freed as each update ends. On the first step that memory is there, since
  the AdamW states, 8 bytes per element, are created by the first update; where it is not, the step stops
  with an error that says so.

Gradients never reach `param.grad`: the rewritten backward hands them to `reduce_grads` and returns None
for those parameters, and `protrain_fx.optim.AdamW` steps from the manager.

The manager is one object per model, `ChunkManager`, made of parts, each in its own module with the state it owns:

| module | owns |
| --- | --- |
| `common.py` | the attributes set on parameters and models, `skips_nonfinite`, the errors for a replaced, tied or unfrozen parameter |
| `storage.py` | `ChunkStorage` (`manager.storage`, a part of its own): the chunks' memory (`flat`, `master`, `grad`, the host arena, the gradient pools), built again by each placement, which chunks are where (persistent, sharded on the device, offloaded), and where this rank's elements of a chunk are |
| `slots.py` | `SlotPool`: the gradient buffers (device) or shards (host) a group of chunks shares in turn |
| `placement.py` | `ChunkPlacement` (`manager.placement`, a part of its own): the parameters moved into the chunks; `place` for a pending manager, `place_again` (a re-plan); the offloaded chunks' buffer count |
| `gather.py` | `Gatherer` (`manager.gathering`, a part of its own): the offloaded chunks' device buffers, gather, prefetch, release |
| `reduce.py` | the backward's gradients into the chunks, across ranks: three paths |
| `arrivals.py` | `Arrivals` (`manager.arrivals`, a part of its own): when a chunk's gradient of the step is complete |
| `reduce_buffers.py` | `ReduceBuffers` (`manager.reduce_buffers`, a part of its own): the buffers gradients are reduced in, in turn |
| `updates.py` | when each chunk's AdamW update runs: early, deferred, speculative; the end of a step |
| `nonfinite.py` | `NonfiniteFlags` (`manager.nonfinite`, a part of its own): the step's inf/NaN flag, and as each update saw it |
| `host_updates.py` | `HostUpdates` (`manager.host_updates`, a part of its own): the worker thread's task for each offloaded chunk |
| `owners.py` | `Owners` (`manager.owners`, a part of its own): the AdamW stepping each chunk |
| `hyper.py` | `HyperparametersSeen` (`manager.hyper`, a part of its own): the hyperparameters a step's updates started with |
| `step_state.py` | `StepState` (`manager.step_state`, a part of its own): the step's phase and the updates it started |
| `edits.py` | `Edits` (`manager.edits`, a part of its own): changes between backward() and step(); updates wait |
| `step_grads.py` | `StepGrads` (`manager.step_grads`, a part of its own): the chunks and parameters holding a gradient of the step, the all-reduces in flight, the sums left to reduce, the arrival norms; written by reducing and the gradient access alike, through its methods |
| `user_grads.py` | `param.grad` of a chunked parameter (runtime/grads.py), `zero_grad` |
| `outside.py` | `Outside` (`manager.outside`, a part of its own): the model used outside the graphs: values read, lent |
| `param_class.py` | `ChunkedParameter`, the chunked parameters' class: Python's calls on an offloaded one run on its values |

This module holds `ChunkManager` itself: its construction, the parts built again at each placement (`rebuild`), and
what the others ask of the whole (which parameters it holds, the collectives over a chunk, publishing an update).
"""

from __future__ import annotations

import collections
import functools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from protrain_fx.distributed import across_ranks, check_ranks_agree, rank_and_world_size
from protrain_fx.planner.chunking import ChunkLayout, Slot
from protrain_fx.planner.plan import MASTER_BYTES
from protrain_fx.runtime import deep_copy, model_hooks, ops
from protrain_fx.runtime.chunks import param_class
from protrain_fx.runtime.chunks.common import (
    DDP_ATTR,
    FROZEN_OUT_ATTR,
    LOADED_MASTER_ATTR,
    MANAGER_ATTR,
    NO_SYNC_ATTR,
    OPTIMIZER_ATTR,
    replaced_param_error,
    skips_nonfinite,
    tied_param_error,
    unfrozen_param_error,
)
from protrain_fx.runtime.chunks.edits import Edits
from protrain_fx.runtime.chunks.gather import Gatherer
from protrain_fx.runtime.chunks.outside import Outside
from protrain_fx.runtime.chunks.placement import ChunkPlacement, check_places
from protrain_fx.runtime.chunks.reduce import ReduceMixin
from protrain_fx.runtime.chunks.step_grads import StepGrads
from protrain_fx.runtime.chunks.storage import ChunkStorage
from protrain_fx.runtime.chunks.updates import UpdatesMixin
from protrain_fx.runtime.chunks.user_grads import GradAccessMixin

log = logging.getLogger(__name__)

__all__ = [
    "DDP_ATTR",
    "FROZEN_OUT_ATTR",
    "LOADED_MASTER_ATTR",
    "MANAGER_ATTR",
    "NO_SYNC_ATTR",
    "OPTIMIZER_ATTR",
    "ChunkManager",
    "replaced_param_error",
    "skips_nonfinite",
    "tied_param_error",
    "unfrozen_param_error",
]


class ChunkManager(
    ReduceMixin,
    UpdatesMixin,
    GradAccessMixin,
):
    """See the module docstring. One per model; shared by all its compiled graphs."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        layout: ChunkLayout,
        *,
        n_persist: int,
        n_buffer: int,
        device: torch.device | None = None,
        source: Callable[[nn.Parameter], torch.Tensor] | None = None,
        model: nn.Module | None = None,
        grad_slots: int | None = None,
        device_grad_slots: int | None = None,
        master_dtype: str = "float32",
        pending_plan: Mapping[str, Any] | None = None,
        n_device_shard: int = 0,
    ):
        """`device` is where the chunks compute (default: the parameters' device). `source(p)` gives a
        parameter's values when they are not in `p` itself yet (a meta-device model); it is called in layout
        order, one parameter at a time. `protrain_fx.prepare` uses both. `model`: the module whose `no_sync`
        state (runtime/adopt.py) says whether a backward is the last of an accumulated step. `grad_slots`: the
        plan's `host_grad_slots`, the gradient shards the offloaded chunks share on the host (default: one each);
        `device_grad_slots`, the plan's fp32 gradient buffers the persistent chunks share (default: one each);
        `master_dtype`, the plan's ("float32", or the parameters' own dtype where MASTER_BYTES names it).
        `pending_plan`: the chunks wait for the first compile's search to place them (`place`); until then every
        chunk is offloaded, each master shard in host memory of its own, and these are the plan fields forced so far
        (`protrain_fx.prepare` without `n_persist`). `n_device_shard`: the chunks after the persistent ones
        sharded across the ranks on the device (the plan's)."""
        check_places(layout.n_chunk, n_persist, n_buffer, n_device_shard)
        rank, world = rank_and_world_size()
        assert layout.world_size in (1, world), "chunk layout was made for another world size"
        # gradients are averaged over all `reduce_world` ranks; chunks are sharded across `world_size` of them
        # (`rank`: this one's shard): all, or none where the layout is for one (a model DistributedDataParallel
        # passes through is whole on every rank, as DDP keeps it: runtime/adopt.py, `pass_through_ddp`)
        self.reduce_world = world
        self.rank, self.world_size = (rank, world) if layout.world_size == world else (0, 1)
        self.layout = layout
        self.params = list(params)
        self.slots: list[Slot] = list(layout.slots)
        self.device = torch.device(device) if device is not None else self.params[0].device
        self.dtype = self.params[0].dtype
        _check_master_dtype(master_dtype, self.dtype)
        # the chunks' memory (storage.py), its persistent chunks those of the placement it was last built for
        self.storage = ChunkStorage(
            layout,
            n_persist=n_persist,
            dtype=self.dtype,
            master_dtype_name=master_dtype,
            device=self.device,
            rank=self.rank,
            world_size=self.world_size,
            wait_for_a_give_back=self._wait_for_a_give_back,
        )
        # the master dtype as the storage keeps it (the plan's name for it, its torch dtype and size). The parameters
        # are their own master (`own_master`): a persistent chunk's update during the backward changes what the rest
        # of the backward would read, so its graphs reduce it after those reads (passes/chunks.py)
        storage = self.storage
        self.master_dtype_name, self.master_dtype, self.master_bytes = (
            storage.master_dtype_name,
            storage.master_dtype,
            storage.master_bytes,
        )
        self.own_master = storage.own_master
        # where the chunks are: the buffers of the offloaded ones, the plan a pending manager waits for (placement.py)
        n_buffer = n_buffer if n_persist < layout.n_chunk else 0
        self.placement = ChunkPlacement(self, n_buffer, pending_plan)
        check_ranks_agree(layout, n_persist, n_buffer, n_device_shard)
        self._index(model)
        self.outside = Outside(self)
        self.step_grads = StepGrads()  # the step's gradients, shared by reducing and the gradient access
        self._init_updates()
        self._init_reduce()
        self._init_grad_access()
        self.edits = Edits(
            self.step_state, loss_scaled=self.dtype == torch.float16, undo_speculative=self.undo_speculative_updates
        )
        assert self.pending_plan is None or n_persist == 0, "a pending manager offloads every chunk"
        self.rebuild(n_persist, grad_slots, device_grad_slots, n_device_shard=n_device_shard)
        self.placement.adopt(source or (lambda p: p.detach()))
        self._attach(model)
        self.handle = ops.register(self)

    def _index(self, model: nn.Module | None) -> None:
        """Each chunked parameter's index, by identity and by every name it has in the model; each chunk's."""
        self.index = {id(p): i for i, p in enumerate(self.params)}
        # every name the chunked parameters have in the model (a tied weight has several) -> its index
        self._by_name = {s.name: i for i, s in enumerate(self.slots)}
        named = model.named_parameters(remove_duplicate=False) if model is not None else ()
        self._by_name.update((n, self.index[id(p)]) for n, p in named if id(p) in self.index)
        self.names = set(self._by_name)
        self._model = weakref.ref(model) if model is not None else None
        self._chunk_params: dict[int, list[int]] = collections.defaultdict(list)  # chunk -> its parameters
        for i, slot in enumerate(self.slots):
            self._chunk_params[slot.chunk].append(i)

    def _attach(self, model: nn.Module | None) -> None:
        """Mark the chunked parameters as this manager's and the model's frozen ones as left out, and hook the
        model's state dict and Python calls (runtime/model_hooks.py)."""
        for p in self.params:
            p.__dict__[MANAGER_ATTR] = self
            param_class.adopt(p)  # (Python's calls on an offloaded one read its values, not freed memory)
        for p in model.parameters() if model is not None else ():
            if not self.holds(p) and not p.requires_grad:
                p.__dict__[FROZEN_OUT_ATTR] = True
        self.outside.note_versions()
        if model is not None:
            hook = model.register_state_dict_post_hook(functools.partial(_full_values_into_state_dict, self))
            deep_copy.note_hooks(model, hook)
            model_hooks.install(self, model)

    @property
    def n_persist(self) -> int:
        """The persistent chunks (the first ones), as the storage was last built."""
        return self.storage.n_persist

    @property
    def n_device_shard(self) -> int:
        """The chunks after the persistent ones sharded across the ranks on the device, as the storage was last
        built."""
        return self.storage.n_device_shard

    @property
    def n_buffer(self) -> int:
        """The offloaded chunks' device buffers, as the chunks were last placed."""
        return self.placement.n_buffer

    @property
    def pending_plan(self) -> dict[str, Any] | None:
        """The plan fields forced so far of a manager whose chunks wait for the first compile's plan; else None."""
        return self.placement.pending_plan

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
        """The chunks' storage for `n_persist` persistent chunks (`ChunkStorage.build`, which takes the other
        arguments), and the parts built around it: the buffers of gathering and reducing, the update stream (at
        construction, and when `placement` places the chunks)."""
        pending = self.pending_plan is not None
        self.storage.build(
            n_persist,
            grad_slots,
            device_grad_slots,
            masters,
            n_device_shard=n_device_shard,
            pending=pending,
            kept=kept,
            reused=reused,
            freed=freed,
        )
        self.gathering = self._new_gatherer()
        self._build_reduce()
        self._build_updates()
        log.info(
            "chunks: %d of %.1f MiB (master %s; %d persistent on %s with %d gradient buffers, %d sharded there, %d "
            "offloaded, a %.1f MiB host arena, %d buffers%s)",
            self.layout.n_chunk,
            self.layout.chunk_bytes / 2**20,
            self.master_dtype,
            n_persist,
            self.device,
            self.storage.device_grad_slots,
            n_device_shard,
            len(self.storage.offloaded()),
            self.storage.arena.numel() / 2**20,
            self.n_buffer,
            "; placed by the first compile's plan" if pending else "",
        )

    def drop_buffers(self) -> None:
        """Let go of the buffers of gathering and reducing (a placement builds them again, `rebuild`)."""
        self.gathering.drop()
        self._drop_reduce_storage()

    def _new_gatherer(self) -> Gatherer:
        """The part that loads the sharded chunks into the plan's `n_buffer` device buffers (gather.py)."""
        offloaded = len(self.storage.offloaded()) > 0  # (a master shard on the device is cast from where it is)
        return Gatherer(
            self,
            n_buffer=self.n_buffer,
            chunk_elems=self.layout.chunk_elems,
            shard=self.storage.shard_bounds(),
            dtype=self.dtype,
            landing_dtype=None if self.own_master or not offloaded else self.master_dtype,
            device=self.device,
            world_size=self.world_size,
        )

    def master_shard(self, chunk: int) -> torch.Tensor:
        """This rank's master shard of offloaded `chunk` (Gatherer's ChunkSource)."""
        return self.storage.master_shard(chunk)

    def version(self, chunk: int) -> int:
        """How many updates of `chunk` have been published (Gatherer's ChunkSource)."""
        return self.storage.version(chunk)

    def publish(self, chunk: int) -> None:
        """After an update: a persistent chunk's parameters take the fp32 master's values; a sharded chunk's
        next gather loads the new master (a buffered copy is stale now). A persistent chunk updated during the
        backward publishes at `end_step` instead."""
        if chunk < self.n_persist and chunk not in self.step_state.early and not self.own_master:
            self.storage.flat[chunk].copy_(self.storage.master[chunk])
        self.storage.published(chunk)

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

    def gather(self, chunk: int) -> torch.Tensor:
        """Offloaded `chunk`'s parameters, whole, in a device buffer (the graphs' `gather` op; gather.py)."""
        assert chunk >= self.n_persist, f"chunk {chunk} is persistent: its parameters are read directly"
        return self.gathering.gather(chunk)

    def prefetch(self, chunk: int) -> None:
        self.gathering.prefetch(chunk)

    def release(self, chunk: int) -> None:
        self.gathering.release(chunk)

    def abandon_step(self) -> None:
        """A forward or backward ran out of memory midway (runtime/oom.py): the chunks it gathered are released."""
        self.gathering.abandon_step()

    @property
    def upload_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream of host-to-device chunk copies (None on the CPU): swap prefetches queue behind it."""
        return self.gathering.copy_stream

    def update_pending(self, chunk: int) -> bool:
        """Whether `chunk`'s host update is queued and not done (Gatherer's ChunkSource)."""
        return self.host_updates.pending(chunk)

    def check_model_params(self) -> None:
        """Each name the chunked parameters had in the model when the chunks were built still names the same
        parameter (a name gone since, its module wrapped, is left alone): a ValueError naming the first that another
        parameter took, tied to it (`module.weight = other.weight`, a parameter of the chunks too) or replaced.
        Checked where a step would start from the model (`protrain_fx.optim.AdamW` built, a graph compiled or
        called), so that it fails there, not in the optimizer's step."""
        model = self._model() if self._model is not None else None
        if model is None:
            return
        now = dict(model.named_parameters(remove_duplicate=False))
        for name, i in self._by_name.items():
            p = now.get(name)
            if p is None or p is self.params[i]:
                continue
            if self.holds(p):
                raise tied_param_error(name, self.slot_of(p).name)
            raise replaced_param_error(name)


def _check_master_dtype(master_dtype: str, dtype: torch.dtype) -> None:
    if master_dtype not in MASTER_BYTES or getattr(torch, master_dtype) not in (torch.float32, dtype):
        raise ValueError(
            f"plan master_dtype={master_dtype!r} does not suit this model, whose parameters are {dtype}: "
            "use 'float32' (fp32 master weights, the default), or 'bfloat16' for a bfloat16 model trained "
            "without fp32 masters"
        )


def _full_values_into_state_dict(
    manager: ChunkManager, module: nn.Module, state_dict: dict, prefix: str, _metadata
) -> None:
    """`model.state_dict()` hook: the parameters' current values, not their storage (emptied when offloaded);
    so `model.state_dict()` and Hugging Face's `save_pretrained` save the trained weights. A collective when
    sharded. `keep_vars=True` still gives the parameters themselves."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        if id(p) in manager.index and name in state_dict:
            if isinstance(state_dict[name], nn.Parameter):
                return
            names.setdefault(id(p), []).append(name)
    for p, values in manager.outside.full_params():
        for name in names.get(id(p), ()):
            state_dict[name] = values
