"""ChunkManager: owns the parameters, gradients and optimizer states of one model, in chunks (paper §3.1).

Layout (planner/chunking.py) decides which parameter is where; the plan decides `n_persist` and
`n_buffer`. Then:

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
- non-persistent chunks: each rank holds its shard (fp32 master, fp32 gradient) in one host arena allocated
  once at its exact size (host.py: pinned with `cudaHostRegister` on CUDA, not the power-of-two host
  allocator; unregistered when the manager is collected). The parameters' own storage is emptied
  (`resize_(0)`): the compiled graphs read them through `gather`, which copies this rank's fp32 master shard
  to the device, casts it into one of `n_buffer` compute-dtype buffers and all-gathers the rest. (Casting on
  the device costs PCIe bytes, which overlap compute, instead of a host cast after every update, which would
  lengthen the host optimizer, the usual bottleneck of offloading.) `release` makes the buffer reusable; a
  chunk still in a buffer when gathered again (backward right after forward) is not copied again, and `prefetch` loads the next
  chunk on a copy stream. Gradients are reduce-scattered in fp32 and copied straight into the shard's fp32
  gradient without blocking (into a staging shard and added, when a chunk gets a second gradient in one
  step), and a worker thread runs the CPU AdamW step of that shard (torch's fused CPU kernel) as soon as
  the copy lands, overlapping the rest of the backward.
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
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from protrain_fx.distributed import across_ranks, check_ranks_agree, rank_and_world_size
from protrain_fx.host import available_host_bytes, check_host_memory, meminfo_bytes, pin_in_place, pinned_arena
from protrain_fx.host_queue import HostQueue
from protrain_fx.planner.chunking import ChunkLayout, Slot
from protrain_fx.planner.plan import HOST_STATES, MASTER_BYTES, REDUCE_BUFFERS
from protrain_fx.progress import progress
from protrain_fx.runtime import model_hooks, ops
from protrain_fx.runtime.grads import ParamGrads

log = logging.getLogger(__name__)

MANAGER_ATTR = "_protrain_chunk_manager"  # set on each managed nn.Parameter: the manager that owns it
OPTIMIZER_ATTR = "_protrain_optimizer"  # set on each parameter of a protrain_fx.optim.AdamW: a weak reference to it
NO_SYNC_ATTR = "_protrain_no_sync"  # on the model: how many `protrain_fx.no_sync` contexts are open
DDP_ATTR = "_protrain_ddp"  # on the model: weak reference to the DistributedDataParallel passing it through
# on a parameter loaded before its chunks were built: its fp32 values (the master; the parameter may be bf16)
LOADED_MASTER_ATTR = "_protrain_loaded_master"


HOST_UPDATES_KEPT = 64  # host AdamW timings kept (ChunkManager.host_updates)
# a clipped model's host updates during the backward keep each shard's master and AdamW states as they were
# (`ChunkManager.speculates`: HOST_STATES elements each), where that leaves UNDO_HOST_RESERVE of the host's memory
# available
UNDO_HOST_RESERVE = 0.1


def _spinning_openmp() -> bool:
    """Whether OpenMP's idle threads spin rather than sleep (read once, when the OpenMP runtime starts)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "ACTIVE"


def skips_nonfinite(optimizer, dtype: torch.dtype) -> bool:
    """Whether `optimizer` (a protrain_fx.optim.AdamW, or None) skips a step with an inf or NaN gradient instead of
    raising, over parameters of `dtype`: its `nonfinite` policy; by default for float16 (loss scaling), not for
    bfloat16 or float32. Such a step's updates all wait for `AdamW.step()`."""
    policy = optimizer.nonfinite if optimizer is not None else None
    return policy == "skip" or (policy is None and dtype == torch.float16)


def replaced_param_error(name: str) -> ValueError:
    return ValueError(
        f"parameter {name!r} was created or replaced after the model's chunks were built (at its first compile, "
        "or by protrain_fx.prepare), so no chunk holds it; create and replace parameters before that, then build "
        "the optimizer and compile"
    )


class ChunkManager:
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
        (`protrain_fx.prepare` without `n_persist`)."""
        if not 0 <= n_persist <= layout.n_chunk:
            raise ValueError(f"plan n_persist={n_persist} must be between 0 and the {layout.n_chunk} chunks")
        if n_persist < layout.n_chunk and n_buffer < 1:
            raise ValueError(f"plan n_buffer={n_buffer}: non-persistent chunks need at least 1 buffer")
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
        self.n_persist = n_persist
        self.n_buffer = n_buffer if n_persist < layout.n_chunk else 0
        self.device = torch.device(device) if device is not None else self.params[0].device
        self.dtype = self.params[0].dtype
        if master_dtype not in MASTER_BYTES or getattr(torch, master_dtype) not in (torch.float32, self.dtype):
            raise ValueError(
                f"plan master_dtype={master_dtype!r} does not suit this model, whose parameters are {self.dtype}: "
                "use 'float32' (fp32 master weights, the default), or 'bfloat16' for a bfloat16 model trained "
                "without fp32 masters"
            )
        self.master_dtype_name = master_dtype  # (as the plan names it)
        self.master_dtype = getattr(torch, master_dtype)
        self.master_bytes = self.master_dtype.itemsize
        # the parameters are their own master: a persistent chunk's update during the backward changes what the
        # rest of the backward would read, so its graphs reduce it after those reads (passes/chunks.py)
        self.own_master = self.dtype == self.master_dtype
        check_ranks_agree(layout, n_persist, n_buffer)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        # every name the chunked parameters have in the model (a tied weight has several) -> its index
        self._by_name = {s.name: i for i, s in enumerate(layout.slots)}
        for n, p in model.named_parameters(remove_duplicate=False) if model is not None else ():
            if id(p) in self.index:
                self._by_name[n] = self.index[id(p)]
        self.names = set(self._by_name)
        self.read_by_graphs: set[int] = set()  # parameters some compiled graph reads (`note_read_by_graph`)
        self._host = HostQueue(spare_core=self.device.type == "cuda")  # runs the offloaded chunks' CPU steps
        if self.device.type == "cuda" and n_persist < layout.n_chunk and _spinning_openmp():
            log.warning(
                "OMP_WAIT_POLICY=ACTIVE: idle OpenMP threads keep spinning, beside the offloaded chunks' CPU AdamW, "
                "which then ran 3x slower in our measurements (a 16-core H100 machine); unset it, or set it to "
                "PASSIVE, before Python starts"
            )
        weakref.finalize(self, self._host.close)
        self._pending: dict[int, concurrent.futures.Future] = {}  # offloaded chunk -> its CPU AdamW step
        self._gives_back: set[int] = set()  # offloaded chunks whose pending host task gives their gradient shard back
        # (parameters, seconds) of the latest host AdamW updates (not those that also copy aside what they change):
        # what the host takes in training, set beside the hardware profile's figure (runtime/monitor.py)
        self.host_updates: collections.deque[tuple[int, float]] = collections.deque(maxlen=HOST_UPDATES_KEPT)
        # the fp32 buffers gradients are reduced in, used in turn, and the copy to the host that last read each (of
        # the buffer, or across ranks of its shard: `_reduce_shards`, this rank's part of the sum, reduce-scattered)
        self._reduce_buffers: list[torch.Tensor] = []
        self._reduce_shards: list[torch.Tensor] = []
        self._n_reduce_buffers = self._reduce_buffer_count()
        self._reduce_read: list[torch.cuda.Event | None] = []
        self._next_reduce = 0
        self._version: dict[int, int] = {}  # chunk -> updates published (written by the worker thread)
        self._buffered_version: dict[int, int] = {}  # chunk -> version its buffered copy holds
        self.has_grad: set[int] = set()  # chunks whose gradient holds this step's values
        self.params_with_grad: set[int] = set()  # parameters (indices) that got a gradient this step
        self._sources: dict[Any, int] = {}  # a compiled frame (for its modules) -> its id in the graphs' ops
        self._grad_sources: dict[int, set[int]] = {}  # chunk -> the sources whose backward reduces into it
        self._arrivals: dict[int, collections.Counter] = {}  # chunk -> source -> its reductions this step
        # source -> its backward passes per optimizer step, as the first step showed: more than one where a step
        # accumulates without no_sync, or where one frame's compiles for two calls (a shared embedding) both run
        self._runs_per_step: dict[int, int] = {}
        self._stepped: set[int] = set()  # chunks whose update has started this step
        # persistent chunks updated during the backward (`_step_persistent_early`): their fp32 master is new, their
        # compute-dtype parameters take it at `end_step` (the rest of the backward may still read them; those that
        # are their own master are new already, the backward's reads of them being done)
        self._early: set[int] = set()
        self._join_queued = False  # the end of this backward waits for its persistent updates (`_join_at_end`)
        self._model = weakref.ref(model) if model is not None else None
        self._unreduced: set[int] = set()  # persistent chunks whose gradient is this rank's sum only (no_sync)
        # persistent chunks' all-reduces in flight, landed in their gradient later (`_land_reductions`), so the
        # backward computes on while the collective runs: (chunk, reduce buffer, work, add into the gradient)
        self._in_flight: list[tuple[int, torch.Tensor, dist.Work, bool]] = []
        # float16 needs loss scaling, whose overflow check must see every gradient of the step before any update:
        # offloaded updates then start in AdamW.step() instead of during the backward (`skips_nonfinite`)
        self.loss_scaled = self.dtype == torch.float16
        self.torch_scaled = False  # stepped by torch.amp.GradScaler (`scale_losses`)
        # gradients or hyperparameters looked at or changed between backward() and optimizer.step() (clipping,
        # loss scaling, gradient logging, an lr set there: `note_edit`), which updates that start during the
        # backward would miss. From the first step that does so, updates wait for `AdamW.step()`, but the last
        # `n_clip_overlap` offloaded chunks, which update during the backward while the last step changed nothing
        # (`speculates`), keeping what the update changes to undo it. The first step always waits
        self.edits_grads = False
        self.last_step_edited = True  # (whether the last step changed gradients or hyperparameters after its backward)
        self._edited_this_step = False
        self.clip_norm_type: float | None = None  # the norm type of the last clip_grad_norm_ call (arrival norms)
        self.n_clip_overlap = 0  # the plan's (planner/plan.py): the last chunks that may update before a clip
        self._first_step = True
        self._speculative: set[int] = set()  # offloaded chunks updated this step with what they changed kept
        self._room_for_undo: bool | None = None  # whether the host can keep that (decided once)
        # offloaded chunk -> the norm (clip_norm_type) of its gradient shard as it arrived, when the arrival is the
        # whole gradient of the step: clipping reads these instead of waiting for the copies to the host
        self._arrival_norms: dict[int, tuple[float, torch.Tensor | None]] = {}  # (None: it arrived in parts)
        # a backward ran out of memory under on_oom="replan" (runtime/oom.py): the step's gradients are ignored
        # until the optimizer step, which skips
        self.step_lost = False
        self._owners: dict[int, object] = {}  # chunk -> the AdamW stepping it (`optimizer_of`), as last looked up
        self._owners_stepped: set[int] = set()  # the optimizers (ids) whose step() ran since the step's backward
        self.in_window = False  # between a step's first gradient and the end of its optimizer steps
        # backward passes per optimizer step, as the first step showed (gradient accumulation without no_sync):
        # a source first seen later is expected that many times a step
        self.backwards_per_step = 1
        # chunks holding a parameter used outside the compiled graphs: their gradient gets that use's part at
        # `AdamW.step()` (`fold_plain_grads`), so they update there
        self.eager_chunks: set[int] = set()
        # the hyperparameters each started update used, and those of the last gradient's arrival, per optimizer
        self._hyper_used: dict[int, list[dict]] = {}
        self.hyper_at_backward: dict[int, list[dict]] = {}
        self.param_grads = ParamGrads(self)  # param.grad of the chunked parameters (runtime/grads.py)
        self._chunk_params: dict[int, list[int]] = collections.defaultdict(list)
        for i, slot in enumerate(layout.slots):
            self._chunk_params[slot.chunk].append(i)
        self.pending_plan = dict(pending_plan) if pending_plan is not None else None
        assert self.pending_plan is None or n_persist == 0, "a pending manager offloads every chunk"
        self._build(grad_slots, device_grad_slots)
        self._adopt(source or (lambda p: p.detach()))
        for p in self.params:
            p.__dict__[MANAGER_ATTR] = self
        self._lent: dict[int, bool] = {}  # offloaded parameters given their values for a forward outside the graphs
        self._param_versions = self._persistent_versions()
        if model is not None:
            model.register_state_dict_post_hook(functools.partial(_full_values_into_state_dict, self))
            model_hooks.install(self, model)
        self.handle = ops.register(self)

    # ----- storage -----------------------------------------------------------------------------------

    def _reduce_buffer_count(self) -> int:
        """As many as chunks reduce their gradients in one (every offloaded chunk, persistent ones across ranks)."""
        n, k = self.layout.n_chunk, self.n_persist
        return max(1, min(REDUCE_BUFFERS, n - k + (k if self.reduce_world > 1 else 0)))

    def _persistent_versions(self) -> dict[int, int]:
        """The parameters of persistent chunks that are not their own master -> their version as the runtime left
        it, to take in what is written into them from outside (an in-place init, say: `_take_outside_writes`)."""
        return {i: p._version for i, p in enumerate(self.params) if not self.own_master and self.is_persistent(p)}

    def _build(
        self,
        grad_slots: int | None,
        device_grad_slots: int | None,
        masters: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """The chunks' storage, zero-filled, for `n_persist` and `n_buffer`; `masters`: the offloaded chunks' host
        master shards, already filled (`place`), pinned here."""
        n, elems, shard = self.layout.n_chunk, self.layout.chunk_elems, self.layout.shard_elems
        self.flat: dict[int, torch.Tensor] = {}  # persistent: chunk -> device params
        self.master: dict[int, torch.Tensor] = {}  # chunk -> fp32 master (device: whole chunk; host: shard)
        self.grad: dict[int, torch.Tensor] = {}  # chunk -> fp32 gradient (device: whole chunk; host: shard)
        self.staging: torch.Tensor | None = None  # host fp32 shard a second gradient of one step lands in
        for c in range(self.n_persist):
            self.flat[c] = torch.zeros(elems, dtype=self.dtype, device=self.device)
            self.master[c] = (
                self.flat[c] if self.own_master else torch.zeros(elems, dtype=self.master_dtype, device=self.device)
            )
        device_slots = self.n_persist if device_grad_slots is None else device_grad_slots
        assert 0 < device_slots <= self.n_persist or device_slots == self.n_persist == 0, (
            f"{device_slots} device gradient buffers (make_plan)"
        )
        self.device_grad_slots = device_slots
        # the persistent chunks' fp32 gradients: one each, or fewer, shared in turn (`_take_device_grad`), each
        # free one with the event of the last update that read it (None: nothing reads it now)
        self._device_grads = [
            torch.zeros(elems, dtype=self.master_dtype, device=self.device) for _ in range(device_slots)
        ]
        self._free_device_grads: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        if self.shares_device_grads:
            self._free_device_grads = [(g, None) for g in self._device_grads]
        else:
            self.grad.update(enumerate(self._device_grads))
        offloaded = list(range(self.n_persist, n))
        slots = len(offloaded) if grad_slots is None else grad_slots
        assert 0 < slots <= len(offloaded) or slots == len(offloaded) == 0, f"{slots} gradient shards (make_plan)"
        self.grad_slots = slots
        # (a pending manager holds only the masters; `place` checks for the AdamW states of the chunks it offloads)
        states = 1 if self.pending_plan is not None else HOST_STATES - (1 if masters is not None else 0)
        check_host_memory(
            shard * self.master_bytes * (states * len(offloaded) + slots),
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
                if masters is not None and pin:
                    pin_in_place(self.master[c], self)
            self.arena = pinned_arena(shard * self.master_bytes * slots, self, pin=pin)
            parts = self.arena.view(self.master_dtype).split(shard) if slots else ()
            if masters is None:
                for c in offloaded:
                    self.master[c].zero_()
        self.arena.zero_()
        # the gradient shards no chunk holds now; where there is one per chunk, each chunk holds its own for good
        self._free_grads: list[torch.Tensor] = list(parts)
        self._grad_lock = threading.Lock()  # (the worker thread gives gradient shards back)
        if slots == len(offloaded):
            self.grad.update(zip(offloaded, self._free_grads))
            self._free_grads = []
        self.buffers = [torch.empty(elems, dtype=self.dtype, device=self.device) for _ in range(self.n_buffer)]
        # where a master shard lands on the device before its cast into a buffer (loads are serial on one stream)
        self._landing = (
            None
            if self.own_master or not offloaded
            else torch.empty(shard, dtype=self.master_dtype, device=self.device)
        )
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None  # host-to-device chunk copies
        self._d2h_stream = torch.cuda.Stream(self.device) if cuda else None  # device-to-host gradient copies
        # persistent chunks' updates during the backward, beside it (memory-bound AdamW next to its matmuls)
        self._optim_stream = torch.cuda.Stream(self.device) if cuda and self.n_persist else None
        self._freed = [torch.cuda.current_stream(self.device).record_event() for _ in self.buffers] if cuda else []
        self._ready: dict[int, torch.cuda.Event] = {}  # chunk -> its copy into a buffer is done
        self._resident: dict[int, int] = {}  # chunk -> buffer holding it
        self.found_inf = torch.zeros(1, device=self.device)  # 1 once a gradient of this step is not finite
        # found_inf as each offloaded chunk's update started during the backward saw it: the update skips if set
        self._found_host = torch.zeros(n, pin_memory=self.device.type == "cuda")
        self._found_early = torch.zeros(self.n_persist, device=self.device)  # the same, of persistent chunks
        self._in_use: set[int] = set()  # chunks gathered and not released yet
        self._released: list[int] = []  # released chunks still in a buffer, least recent first
        log.info(
            "chunks: %d of %.1f MiB (master %s; %d persistent on %s with %d gradient buffers, %d offloaded, a %.1f "
            "MiB host arena, %d buffers%s)",
            n,
            self.layout.chunk_bytes / 2**20,
            self.master_dtype,
            self.n_persist,
            self.device,
            device_slots,
            len(offloaded),
            self.arena.numel() / 2**20,
            self.n_buffer,
            "; placed by the first compile's plan" if self.pending_plan is not None else "",
        )

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

    @property
    def upload_stream(self):
        """The CUDA stream of host-to-device chunk copies (None on the CPU): swap prefetches queue behind it."""
        return self._copy_stream

    @staticmethod
    def _slot_range(slot: Slot) -> tuple[int, int]:
        return slot.offset, slot.offset + slot.numel

    def _shard_bounds(self) -> tuple[int, int]:
        shard = self.layout.shard_elems
        return self.rank * shard, (self.rank + 1) * shard

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

    def check_params(self, indices: Sequence[int], inputs: Sequence[torch.Tensor]) -> None:
        """The parameters a compiled graph was called with must be the ones in the chunks. (And what was written
        into persistent parameters from outside is taken into their masters, `_take_outside_writes`.)"""
        self._take_outside_writes()
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
                raise replaced_param_error(name)

    def holds(self, p: nn.Parameter) -> bool:
        """Whether the parameter is in this manager's chunks."""
        return id(p) in self.index

    def holds_no_values(self, p: nn.Parameter) -> bool:
        """Whether the parameter is offloaded and holds no values of its own now (none lent to Python: `lend`)."""
        return self.holds(p) and not self.is_persistent(p) and self.index[id(p)] not in self._lent

    def is_persistent(self, p: nn.Parameter) -> bool:
        return self.slots[self.index[id(p)]].chunk < self.n_persist

    def slot_of(self, p: nn.Parameter) -> Slot:
        return self.slots[self.index[id(p)]]

    # ----- gather / release --------------------------------------------------------------------------

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

    def abandon_step(self) -> None:
        """A forward or backward ran out of memory midway (runtime/oom.py): the chunks it gathered are released
        (they stay in their buffers, free for reuse)."""
        for chunk in sorted(self._in_use):
            self.release(chunk)

    def lose_step(self) -> None:
        """A backward ran out of memory and its step is given up (on_oom="replan"; after `abandon_step`): its
        gradients so far are dropped and later ones ignored; `AdamW.step()` skips the step and clears this."""
        assert not self._stepped, f"chunks {sorted(self._stepped)} started their update in the lost step"
        self.drop_all_grads()
        self.step_lost = True

    def release(self, chunk: int) -> None:
        """The graph is done with the chunk for now; its buffer may be reused (least recently released first)."""
        self._in_use.discard(chunk)
        if chunk in self._resident and chunk not in self._released:
            self._released.append(chunk)
            if self._copy_stream is not None:  # a copy into this buffer must wait for the reads queued so far
                self._freed[self._resident[chunk]] = torch.cuda.current_stream(self.device).record_event()

    # ----- gradients and the optimizer ---------------------------------------------------------------

    def grad_source(self, key: Any) -> int:
        """The id of a compiled frame (for the modules its locals are) whose backward reduces gradients, for its
        graphs' `reduce_grads` ops."""
        return self._sources.setdefault(key, len(self._sources))

    def expect_gradients(self, chunk: int, source: int) -> None:
        """Compile time: the backward of `source` (`grad_source`) reduces gradients into `chunk`. An offloaded
        chunk steps once every source has, as many times as in the first step (recompiles of one frame for other
        input shapes count once: only one of them runs)."""
        self._grad_sources.setdefault(chunk, set()).add(source)

    def optimizer_of(self, chunk: int):
        """The protrain_fx.optim.AdamW stepping the chunk's parameters (None: no optimizer steps them). The layout
        keeps the parameters of different optimizers in different chunks."""
        ref = self._owners.get(chunk)
        if ref is not None and ref() is not None:
            return ref()
        owners = {}
        for i in self._chunk_params[chunk]:
            ref = self.params[i].__dict__.get(OPTIMIZER_ATTR)
            if ref is not None and ref() is not None:
                owners[id(ref())] = ref
        if len(owners) > 1:
            raise ValueError(
                f"chunk {chunk} holds parameters of {len(owners)} protrain_fx.optim.AdamW optimizers, and a chunk "
                "is stepped by one: build every optimizer before the model's chunks are built (its first compiled "
                "step, or protrain_fx.prepare), so that the layout keeps each optimizer's parameters apart"
            )
        ref = next(iter(owners.values()), None)
        if ref is not None:
            self._owners[chunk] = ref
        return ref() if ref is not None else None

    def forget_owners(self) -> None:
        """A protrain_fx.optim.AdamW was built over some of the parameters: look the chunks' optimizers up again."""
        self._owners.clear()

    def check_owners(self) -> None:
        """Raise now where a chunk holds parameters of several optimizers (`optimizer_of`)."""
        for chunk in range(self.layout.n_chunk):
            self.optimizer_of(chunk)

    @property
    def optimizers(self) -> list:
        """The protrain_fx.optim.AdamW optimizers stepping this model's chunks."""
        found = {}
        for chunk in range(self.layout.n_chunk):
            owner = self.optimizer_of(chunk)
            if owner is not None:
                found[id(owner)] = owner
        return list(found.values())

    @property
    def skips_nonfinite(self) -> bool:
        """A step with an inf or NaN gradient is skipped (on every rank), not an error (`skips_nonfinite`)."""
        return self.torch_scaled or any(skips_nonfinite(o, self.dtype) for o in self.optimizers or [None])

    def scale_losses(self, what: str) -> None:
        """`what` scales the loss (torch.amp.GradScaler, seen at a step): from now on every update waits for the
        step, which divides the scale out and skips a step with an inf or NaN gradient."""
        if not self.torch_scaled:
            log.info("%s: chunk updates wait for optimizer.step()", what)
            self.torch_scaled = True
        self._check_not_started(sorted(self._stepped), f"{what}, first seen at this step,")

    @property
    def defer_updates(self) -> bool:
        """Updates start in `AdamW.step()`, not as each chunk's gradient completes (but `speculates`)."""
        return self.skips_nonfinite or self._first_step or self.edits_grads

    def _update_now(self, chunk: int) -> bool:
        """Whether an offloaded chunk whose gradient is complete starts its host update now."""
        if self.optimizer_of(chunk) is None or self.skips_nonfinite or self._first_step or chunk in self.eager_chunks:
            return False
        return not self.edits_grads or (chunk >= self.layout.n_chunk - self.n_clip_overlap and self.speculates)

    @property
    def speculates(self) -> bool:
        """A model whose gradients or hyperparameters are looked at between backward() and step() (`edits_grads`:
        clipping, say), and whose last step changed none of them, updates its offloaded chunks during the backward
        as if this step will not either, keeping each chunk's master and AdamW states as they were (`snapshot` of
        `AdamW.chunk_update`); if it does, `undo_speculative_updates` puts them back and `AdamW.step()` updates
        again from the changed gradients. Only the last `n_clip_overlap` chunks, as the plan chose (the copy costs
        host memory bandwidth: the cost model weighs it against waiting for the clip), where the host has room."""
        if not self.edits_grads or self.last_step_edited or not self.n_clip_overlap:
            return False
        if self._room_for_undo is None:
            needed = HOST_STATES * self.master_bytes * self.layout.shard_elems * self.n_clip_overlap
            available, total = available_host_bytes(), meminfo_bytes("MemTotal")
            self._room_for_undo = available is None or needed <= available - UNDO_HOST_RESERVE * (total or 0)
            log.info(
                "clipping: %s (keeping the updated chunks' masters and AdamW states takes %.2f GiB of host memory, "
                "%s GiB available)",
                "host updates start during the backward while clipping does not apply"
                if self._room_for_undo
                else "host updates wait for optimizer.step()",
                needed / 2**30,
                "-" if available is None else f"{available / 2**30:.2f}",
            )
        return self._room_for_undo

    def _check_finite(self, grads: Sequence[torch.Tensor]) -> None:
        """Set `found_inf` to 1 if a gradient is inf or NaN: the sum of their L2 norms (torch's foreach norm,
        accumulated in fp32) is not finite. On the device, no sync, and each gradient is only read, once (a norm
        also overflows past about 1e19, where training has failed anyway). `AdamW.step()` reads it, and the fused
        AdamW skips an update where it is exactly 1."""
        norms = torch._foreach_norm(list(grads), 2, dtype=torch.promote_types(grads[0].dtype, torch.float32))
        nonfinite = torch.isfinite(torch.stack(norms).sum()).logical_not().to(self.found_inf.dtype)
        torch.maximum(self.found_inf, nonfinite, out=self.found_inf)

    @property
    def sync_grads(self) -> bool:
        """False inside `protrain_fx.no_sync(model)`, or the `no_sync` of the DistributedDataParallel passing the
        model through (runtime/adopt.py, `pass_through_ddp`): backward passes only add their gradients up."""
        model = self._model() if self._model is not None else None
        if model is None:
            return True
        ddp = model.__dict__[DDP_ATTR]() if DDP_ATTR in model.__dict__ else None
        return not model.__dict__.get(NO_SYNC_ATTR, 0) and (ddp is None or ddp.require_backward_grad_sync)

    def reduce_grads(
        self, chunk: int, source: int, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]
    ) -> None:
        """Add a chunk's gradients into its fp32 gradient; offloaded chunks then start their CPU AdamW step.

        Offloaded: the fp32 gradient shard is copied to the host without blocking (straight into the shard's
        gradient when it is the step's first); once the last expected gradient of the chunk is in, the worker
        thread waits for that copy and steps the chunk while the device goes on with the backward.
        Inside `no_sync` (gradient accumulation) nothing steps, and persistent chunks are not reduced across
        ranks: each rank adds up its own until the step's last backward, which reduces the sum once.
        Offloaded shards are reduce-scattered every time (a rank holds only its shard of their gradient).
        """
        if self.step_lost:  # (a later graph's backward after an out-of-memory error lost the step)
            return
        persistent = chunk < self.n_persist
        if chunk in self._stepped:
            raise RuntimeError(
                f"chunk {chunk} got a gradient after its optimizer step had started in this step (a backward ran "
                "twice between optimizer steps, or a compiled graph ran twice in one forward); call "
                "optimizer.step() after each backward, or, to accumulate gradients over several backward passes, "
                "run all but the last inside `with protrain_fx.no_sync(model):`"
            )
        self._reconcile(chunk)
        indices = [self.index[id(p)] for p in params]
        grads = self._with_plain_grads(indices, grads)
        owner = self.optimizer_of(chunk)
        if owner is not None:
            self.hyper_at_backward[id(owner)] = owner.hyperparameters()
        self.in_window = True
        accumulate = chunk in self.has_grad  # the first gradient of a step overwrites: zero_grad never memsets
        self.has_grad.add(chunk)
        sync = self.sync_grads
        if sync:  # (the arrivals of the step's last backward decide when a chunk is complete)
            self._arrivals.setdefault(chunk, collections.Counter())[source] += 1
        if persistent and self.reduce_world == 1:
            # straight into the fp32 gradient; where a parameter has no gradient yet this step its slot holds a
            # stale value, which is overwritten here or never read (the optimizer skips that parameter)
            grad = self._take_device_grad(chunk, accumulate)
            seen = [self.index[id(p)] in self.params_with_grad for p in params]
            written = self._write_grads(grad, params, grads, seen)
            # the gradients as they came (compute dtype: fewer bytes read), or as added up (a sum may overflow)
            self._check_finite(written if any(seen) else grads)
            self.params_with_grad.update(indices)
            self.param_grads.publish(indices)
            self._step_persistent_early(chunk)
            return
        self.params_with_grad.update(indices)
        self.param_grads.publish(indices)
        self._land_reductions()  # (at most one in flight: the reduce buffer it holds is the next to be taken)
        flat, slot = self._reduce_buffer()
        self._write_grads(flat, params, grads, [False] * len(params))
        if persistent:
            if not sync:  # this rank's sum, reduced at the step's last backward
                self._unreduced.add(chunk)
            else:
                if chunk in self._unreduced:  # reduce what this rank added up with this gradient, once
                    flat.add_(self.grad[chunk])
                    self._unreduced.discard(chunk)
                    accumulate = False
                with across_ranks(f"the all-reduce of chunk {chunk}'s gradients"):
                    self._in_flight.append((chunk, flat, dist.all_reduce(flat, async_op=True), accumulate))
                return
            grad = self._take_device_grad(chunk, accumulate)
            grad.add_(flat) if accumulate else grad.copy_(flat)
            return
        if self.world_size > 1:
            with across_ranks(f"the reduce-scatter of chunk {chunk}'s gradients"):
                shard = self._reduce_scatter(flat, self._reduce_shards[slot]).div_(self.world_size)
        elif self.reduce_world > 1:  # (whole on every rank)
            shard = self.all_reduce(flat, dist.ReduceOp.SUM, f"the all-reduce of chunk {chunk}'s gradients")
            shard /= self.reduce_world
        else:
            shard = flat
        self._check_finite([shard])  # (a rank's shard holds every rank's contribution to its elements)
        if self.clip_norm_type is not None:  # (zeros where a parameter got no gradient: the flat buffer was zeroed)
            norm = None if accumulate else torch.linalg.vector_norm(shard, self.clip_norm_type)
            self._arrival_norms[chunk] = (self.clip_norm_type, norm)
        self.wait_for_update(chunk)  # the previous gradient copy of this chunk is taken in
        if accumulate:
            if chunk not in self.grad:
                raise self._taken_step_error(chunk)
            self.wait_for_update()  # the one staging shard is free once every pending copy is taken in
            if self.staging is None:
                self.staging = torch.empty(
                    self.layout.shard_elems, dtype=self.master_dtype, pin_memory=self.device.type == "cuda"
                )
            target = self.staging
        else:
            target = self._take_grad(chunk)
        copied = None
        stream = self._d2h_stream
        if stream is not None:  # off the compute stream, so the copy overlaps the rest of the backward
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            target.copy_(shard, non_blocking=True)
            found = self._found_host[chunk]
            found.copy_(self.found_inf[0], non_blocking=True)
            if stream is not None:
                copied = stream.record_event()
        last = self._complete(chunk) and self._update_now(chunk)
        update, speculative = None, self.edits_grads
        if last:
            self._stepped.add(chunk)
            if speculative:
                self._speculative.add(chunk)
            # hyperparameters and gradients as of now; skipped if a gradient of the step so far is not finite
            update = self._start_update(chunk, found_inf=found, snapshot=speculative)

        self._reduce_read[slot] = copied  # the buffer (and its shard) is reused once this copy has ended

        def take_in() -> None:
            """On the worker thread, once the copy has landed."""
            with torch.profiler.record_function("protrain::cpu_adamw"):
                if accumulate:
                    self.grad[chunk].add_(self.staging)
                if update is not None:
                    start = time.perf_counter()
                    update()
                    if not speculative:  # (one kept for undoing is read again if the clip applies)
                        self.host_updates.append((self.master[chunk].numel(), time.perf_counter() - start))
                        self._give_back_grad(chunk)

        if update is not None and not speculative and self.shares_grads:
            self._gives_back.add(chunk)
        self._pending[chunk] = self._host.submit(chunk, copied, take_in)

    def _write_grads(
        self, flat: torch.Tensor, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor], add: Sequence[bool]
    ) -> list[torch.Tensor]:
        """Each parameter's gradient into its slot of the chunk-long `flat`, copied or, where `add`, added (one
        multi-tensor kernel for each: a chunk holds many small parameters); the slots written."""
        views = [flat[slice(*self._slot_range(self.slot_of(p)))] for p in params]
        for kind, op in ((False, torch._foreach_copy_), (True, torch._foreach_add_)):
            pairs = [(v, g.reshape(-1)) for v, g, a in zip(views, grads, add) if a == kind]
            if pairs:
                op(*map(list, zip(*pairs)))
        return views

    @property
    def shares_grads(self) -> bool:
        """The offloaded chunks share fewer host gradient shards than there are of them (the plan's
        `host_grad_slots`): a chunk holds one from its first gradient of a step until its update has run."""
        return self.grad_slots < self.layout.n_chunk - self.n_persist

    def _take_grad(self, chunk: int) -> torch.Tensor:
        """The host gradient shard the chunk's gradient of this step lands in: its own, or a shared one that is
        free. With none free, wait for a host update that gives one back; with none pending (this step's updates
        wait for `AdamW.step()`), plain host memory for this step, where the host has it."""
        while True:
            with self._grad_lock:
                if chunk not in self.grad and self._free_grads:
                    self.grad[chunk] = self._free_grads.pop()
                if chunk in self.grad:
                    return self.grad[chunk]
            giving = [c for c in self._pending if c in self._gives_back]
            if not giving:
                break
            self.wait_for_update(giving[0])
        offloaded = self.layout.n_chunk - self.n_persist
        check_host_memory(
            self.layout.shard_elems * self.master_bytes,
            f"chunk {chunk}'s gradients",
            f"a {self.master_dtype_name} gradient shard; the plan shares {self.grad_slots} among the {offloaded} "
            "offloaded chunks, and this step holds them all: its host updates wait for optimizer.step() (gradient "
            "clipping, accumulation, float16 loss scaling, or a resumed model's first step)",
            "train without clipping or gradient accumulation, or give the plan more host memory",
        )
        with self._grad_lock:
            self.grad[chunk] = torch.empty(self.layout.shard_elems, dtype=self.master_dtype)
            return self.grad[chunk]

    def _give_back_grad(self, chunk: int) -> None:
        """After the chunk's host update (any thread): a shared gradient shard is free again; one taken for the
        step alone is let go. A chunk's own shard stays."""
        if not self.shares_grads:
            return
        with self._grad_lock:
            self._gives_back.discard(chunk)
            shard = self.grad.pop(chunk, None)
            if shard is not None and shard.untyped_storage().data_ptr() == self.arena.untyped_storage().data_ptr():
                self._free_grads.append(shard)

    @property
    def shares_device_grads(self) -> bool:
        """The persistent chunks share fewer fp32 gradient buffers than there are of them (the plan's
        `device_grad_slots`): a chunk holds one from its first gradient of a step until its update has started."""
        return self.device_grad_slots < self.n_persist

    def grad_is_shared(self, chunk: int) -> bool:
        """Whether the chunk's gradient is given back after its update (its buffer or shard is shared)."""
        return self.shares_device_grads if chunk < self.n_persist else self.shares_grads

    def _take_device_grad(self, chunk: int, accumulate: bool) -> torch.Tensor:
        """The fp32 device gradient a persistent chunk's gradient of this step goes into: its own, or a shared
        one that is free (the compute stream waits, on the device, for the update that last read it). With none
        free (this step's updates wait for `AdamW.step()`, or the chunk's gradient comes in parts), device
        memory for this step, where the GPU has it. `accumulate`: the gradient adds to one of this step. (The
        worker thread touches only offloaded chunks' entries of `grad`: no lock for one get or set.)"""
        grad = self.grad.get(chunk)
        if grad is not None:
            return grad
        if accumulate:
            raise self._taken_step_error(chunk)
        if self._free_device_grads:
            grad, read = self._free_device_grads.pop()
            if read is not None:
                torch.cuda.current_stream(self.device).wait_event(read)
        else:
            try:
                grad = torch.empty(self.layout.chunk_elems, dtype=self.master_dtype, device=self.device)
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
        self.grad[chunk] = grad
        return grad

    def _give_back_device_grad(self, chunk: int, stream: torch.cuda.Stream | None = None) -> None:
        """After a persistent chunk's update was queued on `stream` (default: the current one): a shared
        gradient buffer is free once that update has run; one taken for the step alone is let go."""
        if not self.shares_device_grads:
            return
        grad = self.grad.pop(chunk, None)
        if grad is None:
            return
        cuda = self.device.type == "cuda"
        stream = stream or (torch.cuda.current_stream(self.device) if cuda else None)
        if any(grad is g for g in self._device_grads):
            self._free_device_grads.append((grad, stream.record_event() if cuda else None))
        elif cuda:
            grad.record_stream(stream)  # (the allocator hands it out again once the update has run)

    def _taken_step_error(self, chunk: int) -> RuntimeError:
        """A backward adds to the gradient of a chunk given back by the step already taken (no zero_grad)."""
        if chunk < self.n_persist:
            shared = f"{self.device_grad_slots} gradient buffers among the persistent chunks (the GPU"
        else:
            shared = f"{self.grad_slots} gradient shards among the offloaded chunks (the host"
        return RuntimeError(
            f"chunk {chunk} got a gradient to add to that of a step already taken: this plan shares {shared} has "
            "no room for one each), so their gradients do not outlive optimizer.step(); call "
            "optimizer.zero_grad() after each step"
        )

    def _complete(self, chunk: int) -> bool:
        """Whether the chunk's gradient is final for this step: this is the step's last backward (not inside
        `no_sync`) and every compiled frame reducing into the chunk has run its backward, as many times as a step
        has backward passes, as the first step showed (`_runs_per_step`)."""
        expected = sum(self._runs_per_step.get(s, self.backwards_per_step) for s in self._grad_sources.get(chunk, ()))
        return self.sync_grads and sum(self._arrivals.get(chunk, {}).values()) >= expected

    def _start_update(self, chunk: int, **kwargs) -> Callable[[], None]:
        """The chunk's update, to run now (during the backward), with the hyperparameters of this moment."""
        owner = self.optimizer_of(chunk)
        self._hyper_used[chunk] = owner.hyperparameters()
        return owner.chunk_update(self, chunk, **kwargs)

    def _step_persistent_early(self, chunk: int) -> None:
        """Update a persistent chunk as soon as its gradient is final (reduced across ranks), when updates need
        not wait for `AdamW.step()` (`defer_updates`): on CUDA on the optimizer stream, beside the rest of the
        backward. Only the fp32 master and states change now; the compute-dtype parameters, which the rest of the
        backward may still read, take the new master at `end_step`. Parameters that are their own master (an fp32
        model's, or bf16 masters) change now: their graphs reduce the chunk after the backward's last read of them
        (passes/chunks.py). Either way the end of the backward waits for the updates on the device
        (`_join_at_end`), so what runs after it reads the new values. Like an offloaded chunk's update, it skips
        itself if a gradient of the step so far is inf or NaN."""
        if (
            self.optimizer_of(chunk) is None
            or self.defer_updates  # (clipped: GPU memory is not spent on undoing them, they update in step())
            or chunk in self.eager_chunks
            or not self._complete(chunk)
        ):
            return
        self._stepped.add(chunk)
        self._early.add(chunk)
        found = self._found_early[chunk]
        found.copy_(self.found_inf[0])  # as of now: later gradients' flags do not reach this update
        update = self._start_update(chunk, found_inf=found)
        stream = self._optim_stream
        if stream is None:
            update()
            self._give_back_device_grad(chunk)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.profiler.record_function("protrain::gpu_adamw_early"):
            update()
        self._give_back_device_grad(chunk, stream)
        self._join_at_end()

    def _join_early_updates(self) -> None:
        """The compute stream waits (on the device) for the persistent updates started during the backward."""
        if self._optim_stream is not None and self._early:
            torch.cuda.current_stream(self.device).wait_stream(self._optim_stream)

    def _join_at_end(self) -> None:
        """Once per backward that starts persistent updates: its end joins them (autograd's final callback, as
        FSDP's post-backward), so a read of the parameters after `backward()` and before `step()` waits for
        them on the device. (Outside a backward, from `AdamW.step()`, `end_step` joins them.)"""
        if self._join_queued or torch._C._current_graph_task_id() == -1:
            return
        self._join_queued = True

        def join() -> None:
            self._join_queued = False
            self._join_early_updates()

        torch.autograd.Variable._execution_engine.queue_callback(join)

    def _reduce_buffer(self) -> tuple[torch.Tensor, int]:
        """The next of REDUCE_BUFFERS fp32 chunk buffers, zeroed, and its index. Before reusing one, the compute
        stream waits (on the device, the CPU goes on) until the copy to the host that last read it (or, across
        ranks, its shard) has ended: gradients waiting for the link hold no more memory than these buffers, and
        the backward slows down instead where the copies are slower than it. (Shards made anew for each chunk
        would pile up while the copies lag, beyond what the plan counts.)"""
        i = self._next_reduce
        self._next_reduce = (i + 1) % self._n_reduce_buffers
        if i == len(self._reduce_buffers):
            self._reduce_buffers.append(
                torch.empty(self.layout.chunk_elems, dtype=self.master_dtype, device=self.device)
            )
            if self.world_size > 1 and self.n_persist < self.layout.n_chunk:  # offloaded chunks' shards land here
                self._reduce_shards.append(
                    torch.empty(self.layout.shard_elems, dtype=self.master_dtype, device=self.device)
                )
            self._reduce_read.append(None)
        read, self._reduce_read[i] = self._reduce_read[i], None
        if read is not None:
            torch.cuda.current_stream(self.device).wait_event(read)
        return self._reduce_buffers[i].zero_(), i

    def _reduce_scatter(self, flat: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """`shard`, made this rank's shard of the sum of `flat` over ranks (gloo has no reduce-scatter:
        all-reduce, then copy)."""
        if dist.get_backend() == "gloo":
            dist.all_reduce(flat)
            lo, hi = self._shard_bounds()
            return shard.copy_(flat[lo:hi])
        dist.reduce_scatter_tensor(shard, flat)
        return shard

    def unstepped(self, owner=None) -> list[int]:
        """Chunks with a gradient this step whose update has not started (updates deferred to the step, a frame
        reducing into them did not run its backward, or the optimizer was not known yet), of `owner` (an AdamW;
        None: of any): its `step()` steps them."""
        return sorted(c for c in self.has_grad - self._stepped if owner is None or self.optimizer_of(c) is owner)

    def updates_started(self, *, undoable: bool = True) -> list[int]:
        """Chunks whose update has started this step, during the backward (reading this step's gradients).
        `undoable=False` leaves out those `undo_speculative_updates` can put back."""
        return sorted(self._stepped if undoable else self._stepped - self._speculative)

    def arrival_norms(self, norm_type: float) -> dict[int, torch.Tensor]:
        """Offloaded chunk -> the `norm_type` norm of this rank's shard of its gradient (a 0-dim tensor on the
        device), for the chunks whose gradient of this step arrived whole."""
        return {
            chunk: norm
            for chunk, (kind, norm) in self._arrival_norms.items()
            if kind == norm_type and norm is not None and chunk in self.has_grad
        }

    def undo_speculative_updates(self) -> None:
        """Clipping applies after all: the chunks updated during the backward (`speculates`) take back the
        master and AdamW states they had, and `AdamW.step()` updates them again from the clipped gradients."""
        self.wait_for_update()
        for chunk in sorted(self._speculative):
            self.optimizer_of(chunk).restore(self, chunk)
            self.publish(chunk)  # (the master changed again: a buffered copy is stale)
            self._stepped.discard(chunk)
        self._speculative.clear()

    def _land_reductions(self, *, discard: bool = False) -> None:
        """Put the persistent chunks' all-reduces in flight into their gradients: the compute stream waits for
        each (on the device; the CPU goes on). `discard`: wait only (the step's gradients are being dropped)."""
        for chunk, flat, work, accumulate in self._in_flight:
            with across_ranks(f"the all-reduce of chunk {chunk}'s gradients"):
                work.wait()
            if discard:
                continue
            flat /= self.reduce_world
            self._check_finite([flat])
            grad = self._take_device_grad(chunk, accumulate)
            grad.add_(flat) if accumulate else grad.copy_(flat)
            self._step_persistent_early(chunk)
        self._in_flight.clear()

    def finish_reduction(self) -> None:
        """Before the gradients are read (an optimizer step, clipping): land the all-reduces in flight, and reduce
        the persistent gradients still holding this rank's sum (the step's last backward ran inside `no_sync`)."""
        self._land_reductions()
        for chunk in sorted(self._unreduced):
            with across_ranks(f"the all-reduce of chunk {chunk}'s accumulated gradients"):
                dist.all_reduce(self.grad[chunk])
            self.grad[chunk] /= self.reduce_world
            self._check_finite([self.grad[chunk]])
        self._unreduced.clear()

    def submit_update(self, chunk: int, update: Callable[[], None]) -> None:
        """Start a chunk's update now (from `AdamW.step()`): a persistent chunk's on the device, an offloaded
        chunk's on the worker thread."""
        if chunk < self.n_persist:
            self._stepped.add(chunk)
            update()
            self._give_back_device_grad(chunk)
            return
        self.wait_for_update(chunk)  # its gradient copy is taken in
        self._stepped.add(chunk)

        def update_and_give_back() -> None:
            update()
            self._give_back_grad(chunk)

        if self.shares_grads:
            self._gives_back.add(chunk)
        self._pending[chunk] = self._host.submit(chunk, None, update_and_give_back)

    def end_step(self, owner=None) -> None:
        """After `owner`'s step (an AdamW; None: every chunk's step is over): its chunks' next gradient starts a new
        step (gradients still add up until zero_grad, as in torch). Once every optimizer holding a chunk with a
        gradient has stepped, the step is over."""
        chunks = set(range(self.layout.n_chunk))
        if owner is not None:
            chunks = {c for c in chunks if self.optimizer_of(c) is owner}
            self._owners_stepped.add(id(owner))
            self.hyper_at_backward.pop(id(owner), None)
        self._join_early_updates()
        self._join_queued = False  # (a backward that raised ran no final callback)
        for chunk in sorted(self._early & chunks):  # the parameters take the masters updated during the backward
            self._early.discard(chunk)
            self.publish(chunk)
        if self._first_step:  # (how many backward passes the first step had, per source)
            counts = [(s, n) for c in chunks & self._arrivals.keys() for s, n in self._arrivals[c].items()]
            for s, n in counts:
                self._runs_per_step[s] = max(n, self._runs_per_step.get(s, 0))
            self.backwards_per_step = max(1, min((n for _, n in counts), default=1))
        for kept in (self._arrivals, self._arrival_norms, self._hyper_used):
            for chunk in chunks & kept.keys():
                del kept[chunk]
        self._stepped -= chunks
        self._speculative -= chunks
        waiting = {id(o) for c in self.has_grad if (o := self.optimizer_of(c)) is not None} - self._owners_stepped
        if self.in_window and (owner is None or not waiting):
            if self.has_grad:  # (zero_grad before the first backward does not end the first step)
                self._first_step = False
            self.found_inf.zero_()
            self.take_back(all_of_them=True)  # (parameters lent to a forward outside the graphs: stale now)
            self.last_step_edited, self._edited_this_step = self._edited_this_step, False
            self.in_window = False
            self._owners_stepped.clear()
            self.hyper_at_backward.clear()

    def wait_for_update(self, chunk: int | None = None) -> None:
        """Block until the CPU optimizer step of `chunk` (of every chunk if None) is done; a persistent chunk's
        update during the backward is waited for on the device (the current stream waits for it)."""
        if chunk is None or chunk < self.n_persist:
            self._join_early_updates()
        for c in [chunk] if chunk is not None else list(self._pending):
            future = self._pending.pop(c, None)
            if future is not None:
                future.result()

    def zero_grad(self) -> None:
        """After the parameters' `.grad` were set to None (by an optimizer's `zero_grad`): the chunks forget those
        gradients, and the next one overwrites each chunk's gradient (no memset). Shared host gradient shards not
        given back by an update are given back now. Once no chunk holds a gradient, the step is over."""
        self.reconcile_all()
        if not self.has_grad:
            self._land_reductions(discard=True)
            self._unreduced.clear()
            self.end_step()

    def drop_all_grads(self) -> None:
        """Forget every gradient of the step, whatever `.grad` holds (a step lost to an out-of-memory error)."""
        for i in sorted(self.params_with_grad):
            self.params[i].grad = None
        self.zero_grad()

    # ----- param.grad: what runtime/grads.py reads and writes -------------------------------------------------

    def _piece(self, i: int) -> torch.Tensor:
        """This rank's piece of parameter `i`'s gradient in its chunk: parameter-shaped where the rank holds it
        whole, else the flat elements `local_range(i)`."""
        slot = self.slots[i]
        a, b = self._slot_range(slot)
        grad = self.grad[slot.chunk]
        if not self.is_sharded(slot.chunk):
            return grad[a:b].view(self.params[i].shape)
        lo, hi = self._shard_bounds()
        return grad[max(a, lo) - lo : max(min(b, hi), lo) - lo]

    def local_range(self, i: int) -> tuple[int, int]:
        """The elements of parameter `i` (flattened) whose gradient this rank holds."""
        slot = self.slots[i]
        if not self.is_sharded(slot.chunk):
            return 0, slot.numel
        a, b = self._slot_range(slot)
        lo, hi = self._shard_bounds()
        s, e = max(a, lo), min(b, hi)
        return (s - a, e - a) if s < e else (0, 0)

    def grad_is_sharded(self, i: int) -> bool:
        return self.is_sharded(self.slots[i].chunk)

    def _settle_grads(self, chunk: int) -> None:
        """Before a gradient of the chunk is read or written outside the graphs: every reduction landed, the copy
        to the host taken in, what the user did to `.grad` taken into account."""
        self.finish_reduction()
        if chunk >= self.n_persist:
            self.wait_for_update(chunk)
        self._reconcile(chunk)

    def grad_piece(self, i: int) -> torch.Tensor | None:
        """Parameter `i`'s gradient as this rank holds it (`_piece`), None where it has none this step."""
        chunk = self.slots[i].chunk
        self.note_read()
        self._settle_grads(chunk)
        if i not in self.params_with_grad:
            return None
        if chunk not in self.grad:
            raise RuntimeError(
                f"the gradient of {self.slots[i].name!r} is gone: this plan shares {self.grad_slots} host gradient "
                "shards among the offloaded chunks (the host has no room for one each), so a chunk's gradient lasts "
                "only until its update; read .grad between backward() and optimizer.step()"
            )
        return self._piece(i)

    def gather_param_grad(self, i: int, piece: torch.Tensor) -> torch.Tensor:
        """Parameter `i`'s whole gradient (flat, master dtype) from every rank's piece (a collective)."""
        full = torch.zeros(self.slots[i].numel, dtype=self.master_dtype, device=self.device)
        lo, hi = self.local_range(i)
        full[lo:hi] = piece.to(self.device)
        return self.all_reduce(full, dist.ReduceOp.SUM, f"the all-gather of {self.slots[i].name!r}'s gradient")

    def all_reduce(self, t: torch.Tensor, op, what: str) -> torch.Tensor:
        """`t` reduced over the ranks in place (through the device where the backend needs it)."""
        with across_ranks(what):
            if dist.get_backend() == "gloo" or t.device == self.device:
                dist.all_reduce(t, op=op)
                return t
            on_device = t.to(self.device)
            dist.all_reduce(on_device, op=op)
            return t.copy_(on_device)

    def editable_grad(self, i: int, what: str) -> torch.Tensor:
        """Parameter `i`'s gradient piece (`_piece`) for an in-place write outside the graphs (zeros first where it
        has none this step). Its chunk's update must not have started with it (a kept copy undoes it)."""
        chunk = self.slots[i].chunk
        self._settle_grads(chunk)
        self._check_not_started([chunk], f"{what} on the gradient of {self.slots[i].name!r}")
        self.note_edit(what)
        if i not in self.params_with_grad:
            self._new_grad(i)
        return self._piece(i)

    def drop_grad(self, i: int, what: str) -> None:
        """Parameter `i` has no gradient this step any more (`zero_()` of its `.grad`)."""
        chunk = self.slots[i].chunk
        self._settle_grads(chunk)
        if i in self.params_with_grad:
            self._check_not_started([chunk], f"{what} on the gradient of {self.slots[i].name!r}")
            self.note_edit(what)
            self._drop(chunk, [i])

    def _new_grad(self, i: int) -> None:
        """Zeros for parameter `i`'s gradient in its chunk (the chunk's gradient taken, and zeroed, if it has none
        this step: later gradients add to it)."""
        chunk = self.slots[i].chunk
        if chunk not in self.has_grad:
            grad = self._take_device_grad(chunk, False) if chunk < self.n_persist else self._take_grad(chunk)
            grad.zero_()
            self.has_grad.add(chunk)
            self.in_window = True
        else:
            self._piece(i).zero_()
        self.params_with_grad.add(i)
        self.param_grads.publish([i])

    def _reconcile(self, chunk: int) -> None:
        """Parameters of the chunk whose `.grad` the user dropped (set to None, or replaced) since it took their
        gradient leave it: the optimizer skips them, as torch's skips a parameter without a gradient."""
        if chunk not in self.has_grad:
            return
        dropped = [i for i in self._chunk_params[chunk] if i in self.params_with_grad and self.param_grads.cleared(i)]
        if dropped:
            if chunk >= self.n_persist:
                self.wait_for_update(chunk)  # (its copy to the host landed)
            what = f"dropping the gradient of {self.slots[dropped[0]].name!r}"
            self._check_not_started([chunk], what)
            owner = self.optimizer_of(chunk)
            if self.in_window and owner is not None and id(owner) not in self._owners_stepped:
                self.note_edit(what)  # (between its backward and its step)
            self._drop(chunk, dropped)

    def reconcile_all(self) -> None:
        for chunk in sorted(self.has_grad):
            self._reconcile(chunk)

    def _drop(self, chunk: int, indices: Sequence[int]) -> None:
        """The parameters' gradients leave the chunk; a chunk left without any forgets its gradient (a shared
        buffer or shard is given back), else their slices are zeroed, since later gradients add to the chunk's."""
        self.params_with_grad.difference_update(indices)
        if any(i in self.params_with_grad for i in self._chunk_params[chunk]):
            for i in indices:
                self._piece(i).zero_()
            return
        self.has_grad.discard(chunk)
        self._arrival_norms.pop(chunk, None)
        self._unreduced.discard(chunk)
        for entry in [e for e in self._in_flight if e[0] == chunk]:
            entry[2].wait()
            self._in_flight.remove(entry)
        if chunk < self.n_persist:
            self._give_back_device_grad(chunk)
        elif chunk not in self._gives_back:
            self._give_back_grad(chunk)

    def _with_plain_grads(self, indices: Sequence[int], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`grads`, each plus the plain tensor in its parameter's `.grad` (see `fold_plain_grads`)."""
        out = []
        for i, g in zip(indices, grads):
            plain = self.param_grads.take_plain(i)
            out.append(g if plain is None else g + plain.to(g.device, g.dtype))
        return out

    def fold_plain_grads(self) -> None:
        """Before the step: plain tensors in the chunked parameters' `.grad` (autograd's, for a use outside the
        compiled graphs, or the user's) are their gradients: added into the chunks (averaged across ranks, as the
        graphs' gradients are), whose update then waits for the step from now on (`eager_chunks`)."""
        for i, p in enumerate(self.params):
            if p.grad is None or self.param_grads.mine(p.grad):
                continue
            chunk = self.slots[i].chunk
            self._settle_grads(chunk)
            if chunk not in self.eager_chunks:
                log.info(
                    "parameter %r has a gradient from outside the compiled graphs: chunk %d updates in "
                    "optimizer.step() from now on",
                    self.slots[i].name,
                    chunk,
                )
                self.eager_chunks.add(chunk)
            plain = self.param_grads.take_plain(i).to(self.master_dtype)
            if self.reduce_world > 1:
                plain = self.all_reduce(plain.to(self.device), dist.ReduceOp.SUM, "the all-reduce of a gradient")
                plain /= self.reduce_world
            self._check_not_started([chunk], f"the gradient of {self.slots[i].name!r} from outside the graphs")
            if i not in self.params_with_grad:
                self._new_grad(i)
            piece = self._piece(i)
            lo, hi = self.local_range(i)
            piece.add_(plain.reshape(-1)[lo:hi].view(piece.shape).to(piece.device))
            self._check_finite([piece])

    def _check_not_started(self, chunks: Sequence[int], what: str) -> None:
        """A change to the chunks' gradients (or hyperparameters) outside the graphs: their update must not have
        started with them during the backward. Updates that kept a copy of what they changed are undone (and run
        again in the step); others cannot be, which is an error."""
        started = sorted(set(chunks) & self._stepped)
        if not started:
            return
        self.note_edit(what)
        if set(started) <= self._speculative:
            self.undo_speculative_updates()
            return
        raise RuntimeError(
            f"{what}: the optimizer update of chunk(s) {started} had started during the backward with things as "
            "they were then (chunks update as soon as their gradient is complete, unless an earlier step changed "
            "gradients or hyperparameters between backward() and optimizer.step()). From the next step on updates "
            "wait for optimizer.step(); this step's cannot be redone, so resume from the last checkpoint. To avoid "
            "it, make such changes in every step, from the first (clip every step, say), or before the forward"
        )

    def note_read(self) -> None:
        """A gradient is read outside the graphs between backward() and optimizer.step() (clipping or logging a
        norm): from now on updates wait for the step, where the gradient may have been changed."""
        if self.in_window:
            self.expect_edits("gradients read")

    def expect_edits(self, what: str) -> None:
        """Gradients or hyperparameters are looked at, and may be changed, between backward() and step() (not by a
        backward): from now on updates wait for the step (`edits_grads`)."""
        if torch._C._current_graph_task_id() != -1:
            return
        if not self.edits_grads:
            log.info("%s between backward() and optimizer.step(): chunk updates wait for the step", what)
        self.edits_grads = True

    def note_edit(self, what: str) -> None:
        """Gradients or hyperparameters changed between backward() and optimizer.step() (not by a backward)."""
        if torch._C._current_graph_task_id() != -1:
            return
        self.expect_edits(what)
        self._edited_this_step = True

    def edit_grads(self, what: str) -> None:
        """Every gradient of the step is about to change (clipping): updates that started with them are undone
        where they kept a copy, and an error otherwise."""
        self.note_edit(what)
        self._check_not_started(sorted(self._stepped), what)

    def carried_scale(self) -> float | None:
        """The loss scale the gradients carry, as announced by `protrain_fx.amp.GradScaler.unscale_`."""
        return next((o.carried_scale for o in self.optimizers if o.carried_scale is not None), None)

    def note_hyperparameter_set(self, owner, key: str) -> None:
        """`owner`'s hyperparameter `key` was set: between the backward and `owner`'s step, its updates must see
        it, from this step on (the value may be the same: what is set after the backward counts)."""
        if (
            self.in_window
            and id(owner) not in self._owners_stepped
            and any(self.optimizer_of(c) is owner for c in self.has_grad)
        ):
            self.note_edit(f"the optimizer's {key!r} set")

    def check_hyperparameters(self, owner, now: list[dict]) -> None:
        """At `owner`'s step: hyperparameters changed since its chunks' gradients arrived apply to this step, as in
        torch's AdamW (the updates started with the old ones are undone, where they can be)."""
        seen = self.hyper_at_backward.get(id(owner))
        stale = [c for c, used in self._hyper_used.items() if self.optimizer_of(c) is owner and used != now]
        if (seen is not None and seen != now) or stale:
            self.note_edit("hyperparameters (lr, betas, eps, weight_decay) set")
            self._check_not_started(stale, "hyperparameters (lr, betas, eps, weight_decay) set after the backward")

    def param_pieces(self, chunk: int) -> list[tuple[int, int, int, int]]:
        """(param index, start, end, first element of the parameter) of this rank's pieces of a chunk: `start`
        and `end` in piece coordinates (the whole chunk when persistent, else this rank's shard)."""
        lo, hi = (0, self.layout.chunk_elems) if chunk < self.n_persist else self._shard_bounds()
        pieces = []
        for i, slot in enumerate(self.slots):
            if slot.chunk != chunk:
                continue
            a, b = self._slot_range(slot)
            s, e = max(a, lo), min(b, hi)
            if s < e:
                pieces.append((i, s - lo, e - lo, s - a))
        return pieces

    def is_sharded(self, chunk: int) -> bool:
        return chunk >= self.n_persist and self.world_size > 1

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

    def publish(self, chunk: int) -> None:
        """After an update: a persistent chunk's parameters take the fp32 master's values; an offloaded chunk's
        next gather loads the new master (a buffered copy is stale now). A persistent chunk updated during the
        backward publishes at `end_step` instead."""
        if chunk < self.n_persist and chunk not in self._early and not self.own_master:
            self.flat[chunk].copy_(self.master[chunk])
        self._version[chunk] = self._version.get(chunk, 0) + 1

    # ----- the model used outside the compiled graphs (runtime/model_hooks.py) ------------------------------------

    def _take_outside_writes(self) -> None:
        """Parameters of a persistent chunk written in place from outside the runtime (`nn.init`, a user's
        `p.mul_(...)`: their version moved; the runtime writes their chunk, not them) take their masters with
        them, where the parameters are not their own master."""
        for i, version in self._param_versions.items():
            p = self.params[i]
            if p._version != version:
                slot = self.slots[i]
                a, b = self._slot_range(slot)
                self._join_early_updates()
                self.master[slot.chunk][a:b].copy_(p.detach().reshape(-1))
                self._param_versions[i] = p._version

    def param_values(self, i: int) -> torch.Tensor:
        """Parameter `i`'s current values, whole, in the compute dtype on the chunks' device (a collective where its
        chunk is sharded)."""
        slot = self.slots[i]
        a, b = self._slot_range(slot)
        self.wait_for_update(slot.chunk)
        if slot.chunk < self.n_persist:
            return self.params[i].detach()
        flat = self.full_values(slot.chunk) if self.world_size > 1 else self.master[slot.chunk]
        return flat[a:b].to(self.device, self.dtype).view(self.params[i].shape)

    def note_read_by_graph(self, params) -> None:
        """A compiled graph reads these parameters (it gathers the offloaded ones itself)."""
        self.read_by_graphs.update(self.index[id(p)] for p in params if self.holds(p))

    def lend_to_python(self, indices: Sequence[int], *, for_backward: bool) -> None:
        """A compiled forward ends inside these parameters' modules, whose forward Python goes on with: those no
        compiled graph reads get their values (`lend`)."""
        self.lend([i for i in indices if i not in self.read_by_graphs], for_backward=for_backward)

    def lend(self, indices: Sequence[int], *, for_backward: bool) -> None:
        """A forward outside the compiled graphs is about to read these parameters: offloaded ones get their values
        (storage of their own again) until `take_back`, or the end of the step where the backward may read them.
        Where their gradients will come (`for_backward`), their chunks update in the step (`eager_chunks`)."""
        for i in indices:
            p = self.params[i]
            if for_backward and p.requires_grad:
                self.eager_chunks.add(self.slots[i].chunk)
            if self.is_persistent(p):
                continue
            if i not in self._lent:
                values = self.param_values(i)
                p.untyped_storage().resize_((p.storage_offset() + p.numel()) * p.element_size())
                with torch.no_grad():
                    p.copy_(values)
            self._lent[i] = self._lent.get(i, False) or (for_backward and p.requires_grad)

    def take_back(self, indices: Sequence[int] | None = None, *, all_of_them: bool = False) -> None:
        """Offloaded parameters lent for a forward give their storage back, but those the backward may still read
        (until `end_step`, which takes back `all_of_them`)."""
        for i in list(self._lent if indices is None else indices):
            if i in self._lent and (all_of_them or not self._lent[i]):
                del self._lent[i]
                self.params[i].untyped_storage().resize_(0)

    def load_param(self, i: int, value: torch.Tensor) -> None:
        """Parameter `i` takes `value` (whole, parameter-shaped; model.load_state_dict): its master and compute
        copy, this rank's part where sharded. Its optimizer states stay, as torch's do."""
        slot = self.slots[i]
        a, b = self._slot_range(slot)
        self.wait_for_update(slot.chunk)
        self._join_early_updates()
        flat = value.detach().reshape(-1)
        lo, hi = (0, self.layout.chunk_elems) if not self.is_sharded(slot.chunk) else self._shard_bounds()
        s, e = max(a, lo), min(b, hi)
        if s < e:
            with torch.no_grad():
                self.master[slot.chunk][s - lo : e - lo].copy_(flat[s - a : e - a])
        if slot.chunk < self.n_persist and self.own_master:
            self._version[slot.chunk] = self._version.get(slot.chunk, 0) + 1
        else:
            self.publish(slot.chunk)
        if i in self._lent:
            with torch.no_grad():
                self.params[i].copy_(value)

    def full_params(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Every parameter with its current values, whole, on the host in the compute dtype, fetched chunk by
        chunk: the host holds one chunk besides the values already handed out. A collective when sharded (every
        rank must exhaust it)."""
        self.wait_for_update()
        for chunk in range(self.layout.n_chunk):
            flat = self.full_values(chunk)
            for p, slot in zip(self.params, self.slots):
                if slot.chunk == chunk:
                    yield p, flat[slot.offset : slot.offset + slot.numel].view(p.shape).clone()

    def full_values(self, chunk: int) -> torch.Tensor:
        """The chunk's current parameters, whole, on the host (a collective when sharded). A persistent chunk
        updated during this step's backward gives its new master, as an offloaded chunk does."""
        if chunk < self.n_persist:
            if chunk in self._early:
                self._join_early_updates()
                return self.master[chunk].to("cpu", self.dtype)
            return self.flat[chunk].to("cpu")
        if self.world_size == 1:
            return self.master[chunk].to(self.dtype, copy=True)
        out = torch.empty(self.layout.chunk_elems, dtype=self.dtype, device=self.device)
        with across_ranks(f"the all-gather of chunk {chunk}'s weights"):
            dist.all_gather_into_tensor(out, self.master[chunk].to(self.device, self.dtype))
        return out.to("cpu")


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
    for p, values in manager.full_params():
        for name in names.get(id(p), ()):
            state_dict[name] = values
