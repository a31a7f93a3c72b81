"""UpdatesMixin: when each chunk's AdamW update runs, and the step it belongs to.

A chunk's update runs on one of three paths:
- early: as soon as its gradient is complete, during the backward: a persistent chunk's, or one sharded on the
  device, on the device, on a stream beside the rest of the backward (`_step_on_device_early`; a persistent chunk's
  compute-dtype parameters take the new master at `end_step`, those that are their own master change at once), an offloaded chunk's on the worker thread behind the
  copy of its gradient shard (`_update_on_arrival`, `_queue_host_update`), overlapping the rest of the backward;
- deferred: in `AdamW.step()` (`submit_update`), where something must see every gradient first (`defer_updates`:
  the first step, float16 loss scaling or nonfinite='skip', gradients or hyperparameters changed between backward()
  and step(): runtime/chunks/edits.py, or said to be at the start: `AdamW(edits_after_backward=True)`), or the chunk
  holds a parameter used outside the graphs (`eager_chunks`);
- speculative: a clipped model whose last step was not clipped updates its last `n_clip_overlap` offloaded chunks
  early, keeping what the update changes (`speculates`); where the clip applies after all,
  `undo_speculative_updates` puts it back and the step updates them again.

An update started early with the gradients and hyperparameters of the backward cannot be undone (no copy was kept).
A change the loop makes after it, to the same optimizer's step, is refused (`refuse_edit`) and the step applies as the
backward left it; a step skipped after it (its gradients dropped before `step()`) is applied whole, as
`step()` then `zero_grad()` would (`keep_started_step`). Either way that step is the only one the change misses,
the error says so, and from the next step on updates wait for `step()`, so that later changes apply exactly.

State it owns:
- `host_updates` (host_updates.py, a part of its own: the worker thread, each offloaded chunk's queued task, the
  timings of the latest host updates), `_optim_stream` (persistent early updates);
- the step: `step_state` (step_state.py, a part of its own: the step's phase, the updates it started, those started
  early or speculatively), `_room_for_undo`, `eager_chunks`;
- the optimizers: `owners` (owners.py, a part of its own: chunk -> its AdamW), `hyper` (hyper.py, a part of its
  own: the hyperparameters the step's updates started with, and those of its backward).

`speculates` keeps the updated chunks' states only where the host keeps UNDO_HOST_RESERVE of its memory available.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable

import torch

from protrain_fx.host import available_host_bytes, meminfo_bytes
from protrain_fx.planner.plan import HOST_STATES
from protrain_fx.runtime.chunks.common import skips_nonfinite
from protrain_fx.runtime.chunks.host_updates import HostUpdates
from protrain_fx.runtime.chunks.hyper import HyperparametersSeen
from protrain_fx.runtime.chunks.owners import Owners
from protrain_fx.runtime.chunks.step_state import StepState

log = logging.getLogger(__name__)

# a clipped model's host updates during the backward keep each shard's master and AdamW states as they were
# (`speculates`: HOST_STATES elements each), where that leaves this share of the host's memory available
UNDO_HOST_RESERVE = 0.1

# why a chunk's update ran during the backward, and how a loop says at the start that it changes the step after it
WHY_EARLY = (
    "with the gradients and hyperparameters of then (from the second step on, chunks update as soon as their gradient "
    "is complete, while no earlier step changed gradients or hyperparameters, or skipped, between backward() and "
    "optimizer.step())"
)
SAY_SO = (
    "To have every such change apply exactly from the first, build the optimizer with "
    "protrain_fx.optim.AdamW(..., edits_after_backward=True), or make the change in every step, from the first (clip "
    "every step, say)"
)


def _spinning_openmp() -> bool:
    """Whether OpenMP's idle threads spin rather than sleep (read once, when the OpenMP runtime starts)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "ACTIVE"


class UpdatesMixin:
    """When chunk updates run (module docstring). Part of ChunkManager."""

    def _init_updates(self) -> None:
        self.host_updates = HostUpdates(spare_core=self.device.type == "cuda")  # the worker thread (host_updates.py)
        if self.device.type == "cuda" and self.n_persist < self.layout.n_chunk and _spinning_openmp():
            log.warning(
                "OMP_WAIT_POLICY=ACTIVE: idle OpenMP threads keep spinning, beside the offloaded chunks' CPU AdamW, "
                "which then ran 3x slower in our measurements (a 16-core H100 machine); unset it, or set it to "
                "PASSIVE, before Python starts"
            )
        self.step_state = StepState()  # the step's phase and the updates it started (step_state.py)
        self._room_for_undo: bool | None = None  # whether the host can keep what speculative updates change (once)
        self.owners = Owners(self.params, self._chunk_params, self.layout.n_chunk)  # chunk -> its AdamW (owners.py)
        # chunks holding a parameter used outside the compiled graphs: their gradient gets that use's part at
        # `AdamW.step()` (`fold_plain_grads`), so they update there
        self.eager_chunks: set[int] = set()
        self.hyper = HyperparametersSeen()  # those the step's updates started with, and its backward's (hyper.py)

    def _build_updates(self) -> None:
        """The stream of persistent chunks' updates during the backward, beside it (memory-bound AdamW next to its
        matmuls)."""
        cuda = self.device.type == "cuda"
        on_device = self.n_persist + self.n_device_shard
        self._optim_stream = torch.cuda.Stream(self.device) if cuda and on_device else None

    @property
    def skips_nonfinite(self) -> bool:
        """A step with an inf or NaN gradient is skipped (on every rank), not an error (`skips_nonfinite`)."""
        return self.edits.torch_scaled or any(skips_nonfinite(o, self.dtype) for o in self.owners.all() or [None])

    @property
    def waits_for_edits(self) -> bool:
        """Gradients or hyperparameters may change between backward() and step(), or the step be skipped there: seen
        at a step (`edits.after_backward`), or said at the start (`AdamW(..., edits_after_backward=True)`)."""
        return self.edits.after_backward or any(o.edits_after_backward for o in self.owners.all())

    @property
    def defer_updates(self) -> bool:
        """Updates start in `AdamW.step()`, not as each chunk's gradient completes (but `speculates`)."""
        return self.skips_nonfinite or self.step_state.first or self.waits_for_edits

    def _update_now(self, chunk: int) -> bool:
        """Whether an offloaded chunk whose gradient is complete starts its host update now."""
        if self.owners.of(chunk) is None or self.skips_nonfinite or self.step_state.first or chunk in self.eager_chunks:
            return False
        return not self.waits_for_edits or (
            chunk >= self.layout.n_chunk - self.edits.n_clip_overlap and self.speculates
        )

    @property
    def speculates(self) -> bool:
        """A model whose gradients or hyperparameters are looked at between backward() and step()
        (`edits.after_backward`: clipping, say), and whose last step changed none of them, updates its offloaded
        chunks during the backward as if this step will not either, keeping each chunk's master and AdamW states as
        they were (`snapshot` of `AdamW.chunk_update`); if it does, `undo_speculative_updates` puts them back and
        `AdamW.step()` updates again from the changed gradients. Only the last `n_clip_overlap` chunks, as the plan
        chose (the copy costs host memory bandwidth: the cost model weighs it against waiting for the clip), where
        the host has room."""
        if not self.waits_for_edits or self.step_state.last_edited or not self.edits.n_clip_overlap:
            return False
        if self._room_for_undo is None:
            needed = HOST_STATES * self.master_bytes * self.layout.shard_elems * self.edits.n_clip_overlap
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

    def _start_update(self, chunk: int, **kwargs) -> Callable[[], None]:
        """The chunk's update, to run now (during the backward), with the hyperparameters of this moment."""
        owner = self.owners.of(chunk)
        self.hyper.started(chunk, owner.hyperparameters())
        return owner.chunk_update(self, chunk, **kwargs)

    def _update_on_arrival(self, chunk: int, found: torch.Tensor) -> tuple[Callable[[], None] | None, bool]:
        """An offloaded chunk's gradient shard is on its way to the host: its update, started now where the chunk's
        gradient is complete and it updates during the backward (`_update_now`), with the hyperparameters and
        gradients of this moment, skipped if a gradient of the step so far is not finite (`found`). Returns the
        update (None: it waits for the step) and whether it keeps what it changes (speculative)."""
        speculative = self.waits_for_edits
        if not (self._complete(chunk) and self._update_now(chunk)):
            return None, speculative
        self.step_state.start(chunk, speculative=speculative)
        return self._start_update(chunk, found_inf=found, snapshot=speculative), speculative

    def _queue_host_update(
        self,
        chunk: int,
        copied: torch.cuda.Event | None,
        accumulate: bool,
        update: Callable[[], None] | None,
        speculative: bool,
    ) -> None:
        """Queue on the worker thread, behind the copy `copied`: adding the staged shard into the chunk's gradient
        (`accumulate`), then `update` if any, timed, and the gradient shard given back (but for a speculative
        update, whose shard is read again if the clip applies)."""

        def take_in() -> None:
            """On the worker thread, once the copy has landed."""
            with torch.profiler.record_function("protrain::cpu_adamw"):
                if accumulate:
                    self.storage.grad[chunk].add_(self.staging)
                if update is not None:
                    start = time.perf_counter()
                    update()
                    if not speculative:  # (one kept for undoing is read again if the clip applies)
                        self.host_updates.timed(self.storage.master[chunk].numel(), time.perf_counter() - start)
                        self.storage.host_grads.give_back(chunk)

        if update is not None and not speculative and self.storage.shares_grads:
            self.storage.host_grads.giving.add(chunk)
        self.host_updates.submit(chunk, copied, take_in)

    def _wait_for_a_give_back(self) -> bool:
        """Wait for a queued host update that gives its gradient shard back; False where none is queued."""
        giving = [c for c in self.host_updates.queued() if c in self.storage.host_grads.giving]
        if not giving:
            return False
        self.wait_for_update(giving[0])
        return True

    def _step_on_device_early(self, chunk: int) -> None:
        """Update a persistent chunk, or one sharded on the device (its shard; its next gather loads the new
        master), as soon as its gradient is final (reduced across ranks), when updates need
        not wait for `AdamW.step()` (`defer_updates`): on CUDA on the optimizer stream, beside the rest of the
        backward. Only the fp32 master and states change now; the compute-dtype parameters, which the rest of the
        backward may still read, take the new master at `end_step`. Parameters that are their own master (an fp32
        model's, or bf16 masters) change now: their graphs reduce the chunk after the backward's last read of them
        (passes/chunks.py). Either way the end of the backward waits for the updates on the device
        (`_join_at_end`), so what runs after it reads the new values. Like an offloaded chunk's update, it skips
        itself if a gradient of the step so far is inf or NaN."""
        if (
            self.owners.of(chunk) is None
            or self.defer_updates  # (clipped: GPU memory is not spent on undoing them, they update in step())
            or chunk in self.eager_chunks
            or not self._complete(chunk)
        ):
            return
        self.step_state.start(chunk, early=True)
        found = self.nonfinite.early(chunk)  # as of now: later gradients' flags do not reach this update
        update = self._start_update(chunk, found_inf=found)
        stream = self._optim_stream
        grads = self.storage.grads_of(chunk)
        if stream is None:
            update()
            grads.give_back(chunk)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.profiler.record_function("protrain::gpu_adamw_early"):
            update()
        grads.give_back(chunk, stream)
        self._join_at_end()

    def update_in_step(self, chunk: int) -> None:
        """`chunk` holds a parameter used outside the compiled graphs: it updates in `AdamW.step()` from now on."""
        self.eager_chunks.add(chunk)

    def join_early_updates(self) -> None:
        """The compute stream waits (on the device) for the persistent updates started during the backward."""
        if self._optim_stream is not None and self.step_state.early:
            torch.cuda.current_stream(self.device).wait_stream(self._optim_stream)

    def _join_at_end(self) -> None:
        """Once per backward that starts persistent updates: its end joins them (autograd's final callback, as
        FSDP's post-backward), so a read of the parameters after `backward()` and before `step()` waits for
        them on the device. (Outside a backward, from `AdamW.step()`, `end_step` joins them.)"""
        if self.step_state.join_queued or torch._C._current_graph_task_id() == -1:
            return
        self.step_state.join_queued = True

        def join() -> None:
            self.step_state.join_queued = False
            self.join_early_updates()

        torch.autograd.Variable._execution_engine.queue_callback(join)

    def submit_update(self, chunk: int, update: Callable[[], None]) -> None:
        """Start a chunk's update now (from `AdamW.step()`): a persistent chunk's, or one sharded on the device,
        on the device, an offloaded chunk's on the worker thread."""
        if not self.storage.on_host(chunk):
            self.step_state.start(chunk)
            update()
            self.storage.grads_of(chunk).give_back(chunk)
            return
        self.wait_for_update(chunk)  # its gradient copy is taken in
        self.step_state.start(chunk)

        def update_and_give_back() -> None:
            update()
            self.storage.host_grads.give_back(chunk)

        if self.storage.shares_grads:
            self.storage.host_grads.giving.add(chunk)
        self.host_updates.submit(chunk, None, update_and_give_back)

    def end_step(self, owner=None) -> None:
        """After `owner`'s step (an AdamW; None: every chunk's step is over): its chunks' next gradient starts a new
        step (gradients still add up until zero_grad, as in torch). Once every optimizer holding a chunk with a
        gradient has stepped, the step is over."""
        chunks = set(range(self.layout.n_chunk))
        if owner is not None:
            chunks = {c for c in chunks if self.owners.of(c) is owner}
            self.step_state.optimizers_stepped.add(id(owner))
            self.hyper.stepped(id(owner))
        self.join_early_updates()
        self.step_state.join_queued = False  # (a backward that raised ran no final callback)
        for chunk in sorted(
            self.step_state.early & chunks
        ):  # the parameters take the masters updated during the backward
            self.step_state.early.discard(chunk)
            self.publish(chunk)
        self.arrivals.stepped(chunks, first=self.step_state.first)
        self.hyper.ended(chunks)
        self.step_grads.forget_norms(chunks)
        self.step_state.ended(chunks)
        waiting = {
            id(o) for c in self.step_grads.chunks if (o := self.owners.of(c)) is not None
        } - self.step_state.optimizers_stepped
        if self.step_state.in_window and (owner is None or not waiting):
            self.nonfinite.step_over()
            self.outside.take_back(all_of_them=True)  # (parameters lent to a forward outside the graphs: stale now)
            self.step_state.close(had_grads=bool(self.step_grads.chunks))
            self.hyper.closed()

    def wait_for_update(self, chunk: int | None = None) -> None:
        """Block until the CPU optimizer step of `chunk` (of every chunk if None) is done; a persistent chunk's
        update during the backward (or a chunk's sharded on the device) is waited for on the device (the current
        stream waits for it)."""
        if chunk is None or not self.storage.on_host(chunk):
            self.join_early_updates()
        self.host_updates.wait(chunk)

    def unstepped(self, owner=None) -> list[int]:
        """Chunks with a gradient this step whose update has not started (updates deferred to the step, a frame
        reducing into them did not run its backward, or the optimizer was not known yet), of `owner` (an AdamW;
        None: of any): its `step()` steps them."""
        return sorted(
            c for c in self.step_grads.chunks - self.step_state.started if owner is None or self.owners.of(c) is owner
        )

    def updates_started(self, *, undoable: bool = True) -> list[int]:
        """Chunks whose update has started this step, during the backward (reading this step's gradients).
        `undoable=False` leaves out those `undo_speculative_updates` can put back."""
        return sorted(self.step_state.started if undoable else self.step_state.started - self.step_state.speculative)

    def committed_updates(self, chunks: Iterable[int]) -> list[int]:
        """Chunks of the optimizers stepping `chunks` whose update started during this step's backward and cannot be
        undone (no copy kept: not `speculates`), their optimizer's `step()` not run yet."""
        owners = {id(o) for c in chunks if (o := self.owners.of(c)) is not None}
        return sorted(
            c for c in self.step_state.started - self.step_state.speculative if id(self.owners.of(c)) in owners
        )

    def started_with(self, owner) -> list[dict] | None:
        """The hyperparameters with which `owner`'s updates that cannot be undone started during this step's
        backward (`committed_updates`); None where none did."""
        started = self.committed_updates(c for c in range(self.layout.n_chunk) if self.owners.of(c) is owner)
        return self.hyper.used(started[0]) if started else None

    def refuse_edit(self, what: str, chunks: Iterable[int]) -> None:
        """`what` would change the gradients of `chunks` (between backward() and step()): a RuntimeError, before
        anything changes, where their optimizer's updates of this step started during the backward and cannot be
        undone. The step then applies the gradients as the backward left them, when `step()` runs; later steps wait
        for `step()` (`note_edit`), so that the same change applies to its own step."""
        started = self.committed_updates(chunks)
        if not started:
            return
        self.edits.note_edit(what)
        raise RuntimeError(
            f"{what}: refused, so this step's optimizer update stays as the backward left the gradients (unchanged "
            f"by it; optimizer.step() applies it as usual). The update of chunk(s) {started} had already run during "
            f"backward(), {WHY_EARLY}. From the next step on updates wait for optimizer.step(), so the same change "
            f"applies to its own step exactly. {SAY_SO}"
        )

    def keep_started_step(self, what: str, chunks: Iterable[int], *, set_to_none: bool = True) -> RuntimeError:
        """`what` drops gradients of `chunks` before their optimizer's `step()` (a step skipped after the
        backward, by `zero_grad()`), where updates of that optimizer started during the backward and cannot be
        undone: its step is applied whole, as `step()` would (the other chunks with the gradients and
        hyperparameters of the backward), then every gradient of the step is dropped (`.grad` set to None, or read
        as zeros: `set_to_none` False), as `zero_grad()` would. Returns the error to raise, which says so; later
        steps wait for `step()`, so that a later skip is exact."""
        started = self.committed_updates(chunks)
        owners = {id(o): o for c in started if (o := self.owners.of(c)) is not None}
        self.edits.note_edit(what)
        self.step_state.keeping = True
        try:
            for owner in owners.values():
                owner.step_as_at_backward()
        finally:
            self.step_state.keeping = False
        for chunk in sorted(c for c in self.step_grads.chunks if id(self.owners.of(c)) in owners):
            if set_to_none:
                for i in self._chunk_params[chunk]:
                    self.params[i].grad = None
            self._drop(chunk, self.step_grads.with_grad(self._chunk_params[chunk]))
        self.zero_grad()
        return RuntimeError(
            f"{what} before optimizer.step() (skipping the step?): the update of chunk(s) {started} had already run "
            f"during backward(), {WHY_EARLY}, and cannot be undone. So this step was applied whole, as "
            "optimizer.step() then optimizer.zero_grad() would have (its other chunks too, with the gradients and "
            "hyperparameters of the backward), and its gradients are dropped: training goes on from there, with this "
            "step the only one affected. From the next step on updates wait for optimizer.step(), so a step skipped "
            f"later is skipped exactly. {SAY_SO}"
        )

    def carried_scale(self) -> float | None:
        """The loss scale the gradients carry, as announced by `protrain_fx.amp.GradScaler.unscale_`."""
        return next((o.carried_scale for o in self.owners.all() if o.carried_scale is not None), None)

    def note_hyperparameter_set(self, owner, key: str) -> None:
        """`owner`'s hyperparameter `key` was set: between the backward and `owner`'s step, its updates must see
        it, from this step on (the value may be the same: what is set after the backward counts)."""
        if (
            self.step_state.in_window
            and id(owner) not in self.step_state.optimizers_stepped
            and any(self.owners.of(c) is owner for c in self.step_grads.chunks)
        ):
            self.edits.note_edit(f"the optimizer's {key!r} set")

    def check_hyperparameters(self, owner, now: list[dict]) -> None:
        """At `owner`'s step: hyperparameters changed since its chunks' gradients arrived apply to this step, as in
        torch's AdamW (the updates started with the old ones are undone, where they can be)."""
        mine = [c for c in range(self.layout.n_chunk) if self.owners.of(c) is owner]
        changed, stale = self.hyper.changed(id(owner), now, mine)
        if changed:
            self.edits.note_edit("hyperparameters (lr, betas, eps, weight_decay) set")
            self.edits.check_not_started(stale, "hyperparameters (lr, betas, eps, weight_decay) set after the backward")

    def undo_speculative_updates(self) -> None:
        """Clipping applies after all: the chunks updated during the backward (`speculates`) take back the
        master and AdamW states they had, and `AdamW.step()` updates them again from the clipped gradients."""
        self.wait_for_update()
        for chunk in sorted(self.step_state.speculative):
            self.owners.of(chunk).restore(self, chunk)
            self.publish(chunk)  # (the master changed again: a buffered copy is stale)
            self.step_state.undone(chunk)
