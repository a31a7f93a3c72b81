"""ReduceMixin: each chunk's gradients, from the compiled backward into the chunk's gradient, across ranks.

`reduce_grads` (the graphs' `reduce_grads` op) takes one of three paths:
- a persistent chunk on one rank: straight into its fp32 gradient (`_reduce_persistent_alone`);
- a persistent chunk across ranks: into a reduce buffer, all-reduced without blocking and landed in its gradient
  later (`_reduce_persistent_across_ranks`, `_land_reductions`), so the backward computes on while the collective
  runs; inside `no_sync` each rank adds up its own until the step's last backward, which reduces the sum once;
- a sharded chunk: into a reduce buffer, reduce-scattered (every time: a rank holds only its shard); offloaded,
  copied to the host without blocking (`_reduce_offloaded`), straight into its gradient shard where it is the step's
  first, else into `staging` and added, and once the chunk's last expected gradient is in, its host update is queued
  behind the copy (runtime/chunks/updates.py); sharded on the device, into its gradient shard there, and its update
  may start as a persistent chunk's does (`_land_device_shard`).

State it owns:
- `reduce_buffers`, the part that holds the buffers gradients are reduced in, used in turn (reduce_buffers.py);
- `_d2h_stream`: the CUDA stream of device-to-host gradient copies; `staging`: the host shard a second gradient of
  one step lands in (made when first needed, `_host_target`); both let go of at a placement (`_drop_reduce_storage`);
- `nonfinite` (nonfinite.py, a part of its own): whether a gradient of this step is inf or NaN, and that flag as
  each update during the backward saw it;
- `arrivals` (arrivals.py, a part of its own): the reductions that say when a chunk's gradient is complete.

Which chunks and parameters hold a gradient of this step, the all-reduces in flight, the sums left to reduce and the
arrival norms it writes into `step_grads` (step_grads.py), which the gradient access shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from protrain_fx.distributed import across_ranks
from protrain_fx.planner.plan import REDUCE_BUFFERS
from protrain_fx.runtime.chunks.arrivals import Arrivals
from protrain_fx.runtime.chunks.common import DDP_ATTR, NO_SYNC_ATTR
from protrain_fx.runtime.chunks.nonfinite import NonfiniteFlags
from protrain_fx.runtime.chunks.reduce_buffers import ReduceBuffers


class ReduceMixin:
    """Gradient reduction (module docstring). Part of ChunkManager."""

    def _init_reduce(self) -> None:
        self.arrivals = Arrivals()  # when each chunk's gradient of the step is complete (arrivals.py)
        self.clip_norm_type: float | None = None  # the norm type of the last clip_grad_norm_ call (arrival norms)

    def _build_reduce(self) -> None:
        """The reduce buffers, the copy stream to the host and the non-finite flags, for the chunks as `rebuild` made
        them."""
        cuda = self.device.type == "cuda"
        sharded = self.world_size > 1 and self.n_persist < self.layout.n_chunk  # (offloaded shards land in one)
        self.reduce_buffers = ReduceBuffers(
            self._reduce_buffer_count(),
            chunk_elems=self.layout.chunk_elems,
            shard_elems=self.layout.shard_elems if sharded else None,
            dtype=self.master_dtype,
            device=self.device,
        )
        self.staging: torch.Tensor | None = None  # host fp32 shard a second gradient of one step lands in (lazily)
        self._d2h_stream = torch.cuda.Stream(self.device) if cuda else None  # device-to-host gradient copies
        # whether a gradient of this step is inf or NaN, and as each update during the backward saw it (nonfinite.py)
        on_device = self.n_persist + self.n_device_shard  # (the chunks updated on the device)
        self.nonfinite = NonfiniteFlags(self.layout.n_chunk, on_device, self.device)

    def _drop_reduce_storage(self) -> None:
        """Let go of the reduce buffers and the landing shard (a placement builds them again)."""
        self.reduce_buffers = None
        self.staging = None

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
        if self.step_state.lost:  # (a later graph's backward after an out-of-memory error lost the step)
            return
        if not all(p.requires_grad for p in params):
            # frozen since the graph was compiled (torch 2.11 compiles no new graph for it): no gradient, as in eager
            kept = [(p, g) for p, g in zip(params, grads) if p.requires_grad]
            if not kept:
                return
            params, grads = [p for p, _ in kept], [g for _, g in kept]
        indices = [self.index[id(p)] for p in params]
        accumulate, grads = self._arrive(chunk, source, indices, grads)
        if chunk < self.n_persist and self.reduce_world == 1:
            self._reduce_persistent_alone(chunk, params, grads, indices, accumulate)
            return
        self.step_grads.got(indices)
        self.param_grads.publish(indices)
        self._land_reductions()  # (at most one in flight: the reduce buffer it holds is the next to be taken)
        flat, slot = self.reduce_buffers.take()
        self._write_grads(flat, params, grads, [False] * len(params))
        if chunk < self.n_persist:
            self._reduce_persistent_across_ranks(chunk, flat, accumulate)
        else:
            self._reduce_offloaded(chunk, flat, slot, accumulate)

    def _arrive(
        self, chunk: int, source: int, indices: Sequence[int], grads: Sequence[torch.Tensor]
    ) -> tuple[bool, list[torch.Tensor]]:
        """A gradient of the chunk from `source` arrives: checked against the step, counted, the hyperparameters
        of this moment noted. Returns whether it adds to one of this step, and the gradients with the plain ones
        in `.grad` added (`fold_plain_grads`)."""
        if chunk in self.step_state.started:
            raise RuntimeError(
                f"chunk {chunk} got a gradient after its optimizer step had started in this step (a backward ran "
                "twice between optimizer steps, or a compiled graph ran twice in one forward); call "
                "optimizer.step() after each backward, or, to accumulate gradients over several backward passes, "
                "run all but the last inside `with protrain_fx.no_sync(model):`"
            )
        self._reconcile(chunk)
        grads = self._with_plain_grads(indices, grads)
        owner = self.owners.of(chunk)
        if owner is not None:
            self.hyper.arrived(id(owner), owner.hyperparameters())  # (what its step compares against)
        self.step_state.gradient()
        accumulate = self.step_grads.arrive(chunk)
        if self.sync_grads:  # (the arrivals of the step's last backward decide when a chunk is complete)
            self.arrivals.arrive(chunk, source)
        return accumulate, grads

    def _device_grad(self, chunk: int, accumulate: bool) -> torch.Tensor:
        """The fp32 device gradient a persistent chunk's gradient of this step goes into (`device_grads`).
        `accumulate`: the gradient adds to one of this step, which must still be there. (The worker thread touches
        only offloaded chunks' entries of `grad`.)"""
        if accumulate and chunk not in self.storage.grad:
            raise self._taken_step_error(chunk)
        return self.storage.device_grads.take(chunk)

    def _reduce_persistent_alone(
        self,
        chunk: int,
        params: Sequence[nn.Parameter],
        grads: Sequence[torch.Tensor],
        indices: Sequence[int],
        accumulate: bool,
    ) -> None:
        """One rank: the gradients straight into the chunk's fp32 gradient; where a parameter has no gradient yet
        this step its slot holds a stale value, which is overwritten here or never read (the optimizer skips that
        parameter). Then the chunk's update may start (`_step_on_device_early`)."""
        grad = self._device_grad(chunk, accumulate)
        seen = [self.index[id(p)] in self.step_grads.params for p in params]
        written = self._write_grads(grad, params, grads, seen)
        # the gradients as they came (compute dtype: fewer bytes read), or as added up (a sum may overflow)
        self.nonfinite.check(written if any(seen) else grads)
        self.step_grads.got(indices)
        self.param_grads.publish(indices)
        self._step_on_device_early(chunk)

    def _reduce_persistent_across_ranks(self, chunk: int, flat: torch.Tensor, accumulate: bool) -> None:
        """Several ranks: the reduce buffer `flat` is all-reduced without blocking (landed by `_land_reductions`);
        inside `no_sync` it is added to this rank's sum instead, reduced at the step's last backward."""
        if self.sync_grads:
            if self.step_grads.reduce_now(chunk):  # reduce what this rank added up with this gradient, once
                flat.add_(self.storage.grad[chunk])
                accumulate = False
            with across_ranks(f"the all-reduce of chunk {chunk}'s gradients"):
                self.step_grads.start(chunk, flat, dist.all_reduce(flat, async_op=True), accumulate)
            return
        self.step_grads.reduce_later(chunk)  # this rank's sum, reduced at the step's last backward
        grad = self._device_grad(chunk, accumulate)
        grad.add_(flat) if accumulate else grad.copy_(flat)

    def _reduce_offloaded(self, chunk: int, flat: torch.Tensor, slot: int, accumulate: bool) -> None:
        """This rank's shard of the reduce buffer `flat` (reduce buffer `slot`) to the host, without blocking; the
        chunk's host update is queued behind the copy once its gradient is complete."""
        if self.world_size > 1:
            with across_ranks(f"the reduce-scatter of chunk {chunk}'s gradients"):
                shard = self._reduce_scatter(flat, self.reduce_buffers.shard(slot)).div_(self.world_size)
        elif self.reduce_world > 1:  # (whole on every rank)
            shard = self.all_reduce(flat, dist.ReduceOp.SUM, f"the all-reduce of chunk {chunk}'s gradients")
            shard /= self.reduce_world
        else:
            shard = flat
        self.nonfinite.check([shard])  # (a rank's shard holds every rank's contribution to its elements)
        if self.clip_norm_type is not None:  # (zeros where a parameter got no gradient: the flat buffer was zeroed)
            norm = None if accumulate else torch.linalg.vector_norm(shard, self.clip_norm_type)
            self.step_grads.note_norm(chunk, self.clip_norm_type, norm)
        if not self.storage.on_host(chunk):
            self._land_device_shard(chunk, shard, accumulate)
            self.reduce_buffers.read_by(slot, None)  # (read on the compute stream, which the next taker is on)
            return
        self.wait_for_update(chunk)  # the previous gradient copy of this chunk is taken in
        copied, found = self._copy_to_host(chunk, shard, self._host_target(chunk, accumulate))
        update, speculative = self._update_on_arrival(chunk, found)
        self.reduce_buffers.read_by(slot, copied)  # (reused once this copy has ended)
        self._queue_host_update(chunk, copied, accumulate, update, speculative)

    def _land_device_shard(self, chunk: int, shard: torch.Tensor, accumulate: bool) -> None:
        """A chunk sharded on the device: its reduced `shard` into its gradient shard there (added to the step's
        where it has one), then its update, which starts now where a persistent chunk's would."""
        if accumulate and chunk not in self.storage.grad:
            raise self._taken_step_error(chunk)
        grad = self.storage.grads_of(chunk).take(chunk)
        grad.add_(shard) if accumulate else grad.copy_(shard)
        self._step_on_device_early(chunk)

    def _host_target(self, chunk: int, accumulate: bool) -> torch.Tensor:
        """Where an offloaded chunk's gradient shard lands on the host: its gradient shard (`host_grads`) for the
        step's first gradient, else `staging`, added into it once landed."""
        if not accumulate:
            return self.storage.host_grads.take(chunk)
        if chunk not in self.storage.grad:
            raise self._taken_step_error(chunk)
        self.wait_for_update()  # the one staging shard is free once every pending copy is taken in
        if self.staging is None:
            self.staging = torch.empty(
                self.layout.shard_elems, dtype=self.master_dtype, pin_memory=self.device.type == "cuda"
            )
        return self.staging

    def _copy_to_host(
        self, chunk: int, shard: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.cuda.Event | None, torch.Tensor]:
        """`shard` into the host `target`, and the step's inf/NaN flag into the chunk's, without blocking: on CUDA
        off the compute stream, so the copy overlaps the rest of the backward. Returns the copy's event (None on the
        CPU) and the flag."""
        copied = None
        stream = self._d2h_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            target.copy_(shard, non_blocking=True)
            found = self.nonfinite.to_host(chunk)
            if stream is not None:
                copied = stream.record_event()
        return copied, found

    def _write_grads(
        self, flat: torch.Tensor, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor], add: Sequence[bool]
    ) -> list[torch.Tensor]:
        """Each parameter's gradient into its slot of the chunk-long `flat`, copied or, where `add`, added (one
        multi-tensor kernel for each: a chunk holds many small parameters); the slots written."""
        views = [flat[slice(*self.storage.slot_range(self.slot_of(p)))] for p in params]
        for kind, op in ((False, torch._foreach_copy_), (True, torch._foreach_add_)):
            pairs = [(v, g.reshape(-1)) for v, g, a in zip(views, grads, add) if a == kind]
            if pairs:
                op(*map(list, zip(*pairs)))
        return views

    def _complete(self, chunk: int) -> bool:
        """Whether the chunk's gradient is final for this step: this is the step's last backward (not inside
        `no_sync`) and every compiled frame reducing into the chunk has run its backward as often as a step does."""
        return self.sync_grads and self.arrivals.complete(chunk)

    def _reduce_buffer_count(self) -> int:
        """As many as chunks reduce their gradients in one (every offloaded chunk, persistent ones across ranks)."""
        n, k = self.layout.n_chunk, self.n_persist
        return max(1, min(REDUCE_BUFFERS, n - k + (k if self.reduce_world > 1 else 0)))

    def _reduce_scatter(self, flat: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """`shard`, made this rank's shard of the sum of `flat` over ranks (gloo has no reduce-scatter:
        all-reduce, then copy)."""
        if dist.get_backend() == "gloo":
            dist.all_reduce(flat)
            lo, hi = self.storage.shard_bounds()
            return shard.copy_(flat[lo:hi])
        dist.reduce_scatter_tensor(shard, flat)
        return shard

    def _land_reductions(self, *, discard: bool = False) -> None:
        """Put the persistent chunks' all-reduces in flight into their gradients: the compute stream waits for
        each (on the device; the CPU goes on). `discard`: wait only (the step's gradients are being dropped)."""

        def land(chunk: int, flat: torch.Tensor, work: dist.Work, accumulate: bool) -> None:
            with across_ranks(f"the all-reduce of chunk {chunk}'s gradients"):
                work.wait()
            if discard:
                return
            flat /= self.reduce_world
            self.nonfinite.check([flat])
            grad = self._device_grad(chunk, accumulate)
            grad.add_(flat) if accumulate else grad.copy_(flat)
            self._step_on_device_early(chunk)

        self.step_grads.land(land)

    def finish_reduction(self) -> None:
        """Before the gradients are read (an optimizer step, clipping): land the all-reduces in flight, and reduce
        the persistent gradients still holding this rank's sum (the step's last backward ran inside `no_sync`)."""
        self._land_reductions()

        def reduce(chunk: int) -> None:
            with across_ranks(f"the all-reduce of chunk {chunk}'s accumulated gradients"):
                dist.all_reduce(self.storage.grad[chunk])
            self.storage.grad[chunk].div_(self.reduce_world)
            self.nonfinite.check([self.storage.grad[chunk]])

        self.step_grads.reduce_sums(reduce)

    def _taken_step_error(self, chunk: int) -> RuntimeError:
        """A backward adds to the gradient of a chunk given back by the step already taken (no zero_grad)."""
        if chunk < self.n_persist:
            shared = f"{self.storage.device_grad_slots} gradient buffers among the persistent chunks (the GPU"
        else:
            shared = f"{self.storage.grad_slots} gradient shards among the offloaded chunks (the host"
        return RuntimeError(
            f"chunk {chunk} got a gradient to add to that of a step already taken: this plan shares {shared} has "
            "no room for one each), so their gradients do not outlive optimizer.step(); call "
            "optimizer.zero_grad() after each step"
        )
