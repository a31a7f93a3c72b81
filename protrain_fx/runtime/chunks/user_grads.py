"""GradAccessMixin: a chunked parameter's gradient as `param.grad` shows it (runtime/grads.py reads and writes it
here), and the step's gradients forgotten (`zero_grad`, a lost step).

A parameter's gradient is a slice of its chunk's gradient (`_piece`: parameter-shaped where this rank holds it whole,
else the rank's flat elements of it, `local_range`). Before one is read or written outside the graphs every
reduction lands and the copy to the host is taken in (`_settle_grads`); a write must come before its chunk's update
started (runtime/chunks/edits.py). A `.grad` the user dropped or replaced takes the parameter out of its chunk's
gradient (`_reconcile`); plain tensors in `.grad` (a use outside the compiled graphs) are added into the chunks at
the step (`fold_plain_grads`).

State it owns: `param_grads` (the `ChunkGrad`s of runtime/grads.py). Which chunks and parameters hold a gradient of
this step it reads and changes in `step_grads` (step_grads.py), which the reduce path shares.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from protrain_fx.runtime.grads import ParamGrads

log = logging.getLogger(__name__)


class GradAccessMixin:
    """`param.grad` of the chunked parameters (module docstring). Part of ChunkManager."""

    def _init_grad_access(self) -> None:
        self.param_grads = ParamGrads(self)  # param.grad of the chunked parameters (runtime/grads.py)

    def _piece(self, i: int) -> torch.Tensor:
        """This rank's piece of parameter `i`'s gradient in its chunk: parameter-shaped where the rank holds it
        whole, else the flat elements `local_range(i)`."""
        slot = self.slots[i]
        a, b = self.storage.slot_range(slot)
        grad = self.storage.grad[slot.chunk]
        if not self.storage.is_sharded(slot.chunk):
            return grad[a:b].view(self.params[i].shape)
        lo, hi = self.storage.shard_bounds()
        return grad[max(a, lo) - lo : max(min(b, hi), lo) - lo]

    def local_range(self, i: int) -> tuple[int, int]:
        """The elements of parameter `i` (flattened) whose gradient this rank holds."""
        slot = self.slots[i]
        if not self.storage.is_sharded(slot.chunk):
            return 0, slot.numel
        a, b = self.storage.slot_range(slot)
        lo, hi = self.storage.shard_bounds()
        s, e = max(a, lo), min(b, hi)
        return (s - a, e - a) if s < e else (0, 0)

    def grad_is_sharded(self, i: int) -> bool:
        return self.storage.is_sharded(self.slots[i].chunk)

    def _settle_grads(self, chunk: int, index: int | None = None) -> None:
        """Before a gradient of the chunk (parameter `index`'s, or any) is read or written outside the graphs:
        every reduction landed, the copy to the host taken in, what the user did to that `.grad` taken into account."""
        self.finish_reduction()
        if chunk >= self.n_persist:
            self.wait_for_update(chunk)
        self._reconcile(chunk, None if index is None else (index,))

    def grad_piece(self, i: int) -> torch.Tensor | None:
        """Parameter `i`'s gradient as this rank holds it (`_piece`), None where it has none this step."""
        chunk = self.slots[i].chunk
        self.edits.note_read()
        self._settle_grads(chunk, i)
        if i not in self.step_grads.params:
            return None
        if chunk not in self.storage.grad:
            raise RuntimeError(
                f"the gradient of {self.slots[i].name!r} is gone: this plan shares {self.storage.grad_slots} host gradient "
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

    def editable_grad(self, i: int, what: str, *, create: bool = True) -> torch.Tensor | None:
        """Parameter `i`'s gradient piece (`_piece`) for an in-place write outside the graphs (zeros first where it
        has none this step, or None with `create` False: a scaling leaves no gradient as none). Its chunk's update
        must not have started with it (a kept copy undoes it)."""
        chunk = self.slots[i].chunk
        self._settle_grads(chunk, i)
        if not create and i not in self.step_grads.params:
            self.edits.note_read()
            return None
        if torch._C._current_graph_task_id() == -1:  # (within a backward: autograd accumulating, not an edit)
            self.refuse_edit(f"{what} on the gradient of {self.slots[i].name!r}", [chunk])
        self.edits.check_not_started([chunk], f"{what} on the gradient of {self.slots[i].name!r}")
        self.edits.note_edit(what)
        if i not in self.step_grads.params:
            self._new_grad(i)
        return self._piece(i)

    def drop_grad(self, i: int, what: str) -> None:
        """Parameter `i` has no gradient this step any more (`zero_()` of its `.grad`)."""
        chunk = self.slots[i].chunk
        self._settle_grads(chunk, i)
        if i in self.step_grads.params:
            if self.committed_updates([chunk]):
                raise self.keep_started_step(
                    f"{what} on the gradient of {self.slots[i].name!r}", [chunk], set_to_none=False
                )
            self.edits.check_not_started([chunk], f"{what} on the gradient of {self.slots[i].name!r}")
            self.edits.note_edit(what)
            self._drop(chunk, [i])

    def setting_grad(self, i: int, value: torch.Tensor | None) -> None:
        """The user sets parameter `i`'s `.grad` to `value` (runtime/chunks/param_class.py): where its optimizer's
        updates of this step started during the backward and cannot be undone, a new gradient is refused
        (`refuse_edit`) and None skips the step as it stands (`keep_started_step`), at once; otherwise its chunk
        takes it in when it next reads or adds to its gradient (`_reconcile`, `fold_plain_grads`)."""
        chunk = self.slots[i].chunk
        if self.param_grads.mine(value) or not self.committed_updates([chunk]):
            return
        if value is not None:
            self.refuse_edit(f"a tensor set as the .grad of {self.slots[i].name!r}", [chunk])
        if i in self.step_grads.params:
            self.params[i].grad = None
            raise self.keep_started_step(f"the .grad of {self.slots[i].name!r} set to None", [chunk])

    def _new_grad(self, i: int) -> None:
        """Zeros for parameter `i`'s gradient in its chunk (the chunk's gradient taken, and zeroed, if it has none
        this step: later gradients add to it)."""
        chunk = self.slots[i].chunk
        if chunk not in self.step_grads.chunks:
            grad = (
                self._device_grad(chunk, False) if chunk < self.n_persist else self.storage.grads_of(chunk).take(chunk)
            )
            grad.zero_()
            self.step_grads.arrive(chunk)
            self.step_state.gradient()
        else:
            self._piece(i).zero_()
        self.step_grads.got([i])
        self.param_grads.publish([i])

    def _reconcile(self, chunk: int, indices: Sequence[int] | None = None) -> None:
        """Parameters of the chunk (those of `indices`, or all) whose `.grad` the user dropped (set to None, or
        replaced) since it took their gradient leave it: the optimizer skips them, as torch's skips a parameter
        without a gradient. (A `.grad` op settles its own parameter only: a clip loop would scan each chunk per op.)"""
        if chunk not in self.step_grads.chunks or self.step_state.keeping:
            return
        candidates = self._chunk_params[chunk] if indices is None else indices
        dropped = [i for i in self.step_grads.with_grad(candidates) if self.param_grads.cleared(i)]
        if dropped:
            if self.committed_updates([chunk]):
                raise self.keep_started_step(f"dropping the gradient of {self.slots[dropped[0]].name!r}", [chunk])
            if chunk >= self.n_persist and not self._update_gives_back(chunk, dropped):
                self.wait_for_update(chunk)  # (its copy to the host landed)
            what = f"dropping the gradient of {self.slots[dropped[0]].name!r}"
            self.edits.check_not_started([chunk], what)
            owner = self.owners.of(chunk)
            if self.step_state.in_window and owner is not None and id(owner) not in self.step_state.optimizers_stepped:
                self.edits.note_edit(what)  # (between its backward and its step)
            self._drop(chunk, dropped)

    def reconcile_all(self) -> None:
        for chunk in sorted(self.step_grads.chunks):
            self._reconcile(chunk)

    def _update_gives_back(self, chunk: int, dropped: Sequence[int]) -> bool:
        """Whether the offloaded chunk's whole gradient is dropped while its queued update still reads it and gives
        its host shard back itself (or the shard is the chunk's own): then dropping it need not wait for the update,
        which the next forward's gather of the chunk waits for (`zero_grad` after `step()` would otherwise hold the
        loop until every host update of the step has run, and the next forward would not start beside them)."""
        whole = len(dropped) == len(self.step_grads.with_grad(self._chunk_params[chunk]))
        grads = self.storage.grads_of(chunk)
        return whole and (not grads.shared or chunk in grads.giving)

    def _drop(self, chunk: int, indices: Sequence[int]) -> None:
        """The parameters' gradients leave the chunk; a chunk left without any forgets its gradient (a shared
        buffer or shard is given back), else their slices are zeroed, since later gradients add to the chunk's."""
        self.step_grads.drop(indices)
        if self.step_grads.with_grad(self._chunk_params[chunk]):
            for i in indices:
                self._piece(i).zero_()
            return
        self.step_grads.forget(chunk)
        grads = self.storage.grads_of(chunk)
        if chunk not in grads.giving:
            grads.give_back(chunk)

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
                self.update_in_step(chunk)
            plain = self.param_grads.take_plain(i).to(self.master_dtype)
            if self.reduce_world > 1:
                plain = self.all_reduce(plain.to(self.device), dist.ReduceOp.SUM, "the all-reduce of a gradient")
                plain /= self.reduce_world
            self.edits.check_not_started([chunk], f"the gradient of {self.slots[i].name!r} from outside the graphs")
            if i not in self.step_grads.params:
                self._new_grad(i)
            piece = self._piece(i)
            lo, hi = self.local_range(i)
            piece.add_(plain.reshape(-1)[lo:hi].view(piece.shape).to(piece.device))
            self.nonfinite.check([piece])

    def zero_grad(self) -> None:
        """After the parameters' `.grad` were set to None (by an optimizer's `zero_grad`): the chunks forget those
        gradients, and the next one overwrites each chunk's gradient (no memset). Shared host gradient shards not
        given back by an update are given back now. Once no chunk holds a gradient, the step is over."""
        self.reconcile_all()
        if not self.step_grads.chunks:
            self._land_reductions(discard=True)
            self.step_grads.drop_sums()
            self.end_step()

    def drop_all_grads(self) -> None:
        """Forget every gradient of the step, whatever `.grad` holds (a step lost to an out-of-memory error)."""
        for i in sorted(self.step_grads.params):
            self.params[i].grad = None
        self.zero_grad()

    def lose_step(self) -> None:
        """A backward ran out of memory and its step is given up (on_oom="replan"; after `abandon_step`): its
        gradients so far are dropped and later ones ignored; `AdamW.step()` skips the step and clears this."""
        assert not self.step_state.started, (
            f"chunks {sorted(self.step_state.started)} started their update in the lost step"
        )
        self.drop_all_grads()
        self.step_state.lose()
