"""protrain_fx.optim.AdamW: the optimizer of a model whose states live in chunks (runtime/chunks/).

A `torch.optim.Optimizer` over the model's parameters, with the usual param groups, hyperparameters and
LR schedulers. The update itself is torch's fused AdamW (`torch.optim.AdamW(fused=True)`), run on views
of the chunks: one inner optimizer per chunk piece, whose parameters are views of the master (fp32, or the
parameters themselves: the plan's `master_dtype`) and whose gradients are views of the chunk's gradient (of
the master's dtype), grouped like the outer param groups.

- Offloaded chunks: the manager starts the CPU step of each chunk on its worker thread as soon as the
  chunk's gradient is on the host, overlapping the rest of the backward. `step()` does not wait for them:
  each chunk's next gather waits for its own update, so the next forward overlaps the tail of the CPU work.
  Everything that reads the weights or states (`full_state_dict`, `state_dict()`) waits for all of them.
- Persistent chunks: the manager runs each chunk's update on the GPU as soon as its gradient is final, on a
  stream beside the rest of the backward; the compute-dtype parameters take the new fp32 master in `step()`.
  Parameters that are their own master (a float32 model's, or any with `master_dtype` "bfloat16") change in
  place, once the backward has read them for the last time (the graphs reduce their chunk after that read);
  read between `backward()` and `step()`, they hold the new values, as offloaded chunks' weights do.
- Updates wait for `step()` when the step must see every gradient first: float16 loss scaling (or
  `nonfinite="skip"`), and the first step. With clipping, persistent chunks wait, and the plan's last
  `n_clip_overlap` offloaded chunks update during the backward while the last clip did not apply, keeping a
  copy of what they change to restore and update again if this one does (`ChunkManager.speculates`); the
  others wait.
- Parameters no manager owns (the model was not compiled with protrain) are updated like
  `torch.optim.AdamW` would, from `param.grad`.
Hyperparameters are read from the param groups when a chunk's gradient is complete (during the
backward), so a scheduler's change applies from the next backward on, as with torch's AdamW.
`state_dict()` / `load_state_dict()` (runtime/optim_state.py) use torch's AdamW format (per parameter `step`,
`exp_avg`, `exp_avg_sq`); loaded states are placed when the inner optimizers are built.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from protrain_fx.distributed import across_ranks
from protrain_fx.runtime.chunks import MANAGER_ATTR, OPTIMIZER_ATTR, skips_nonfinite
from protrain_fx.runtime.chunks.param_class import as_plain
from protrain_fx.runtime.chunks.updates import SAY_SO, WHY_EARLY
from protrain_fx.runtime.optim_state import AdamWStates

log = logging.getLogger(__name__)

_HYPER = ("lr", "betas", "eps", "weight_decay")


class AdamW(AdamWStates, torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        nonfinite: str | None = None,
        edits_after_backward: bool = False,
    ):
        """`nonfinite`: what a step whose gradients hold inf or NaN does, on every rank. "raise": stop with a
        `FloatingPointError` before any weight takes such a value (updates already started during the backward
        skip themselves when they see one). "skip": skip the whole step and go on (offloaded chunks then update
        in `step()`, not during the backward). Default: "skip" for float16 chunks (loss scaling with
        `protrain_fx.amp.GradScaler`), "raise" otherwise.
        `edits_after_backward`: the loop may change gradients (clip) or hyperparameters (an lr set), or skip the
        step (`zero_grad()` with no `step()`), between backward() and step() at any step, not only from the first:
        updates wait for `step()` from the first step (but the last `n_clip_overlap` offloaded chunks', undone where
        the step changes), as once a loop did so; otherwise a step changed so after updates started during its
        backward is refused, or applied as the backward left it, with an error that says so."""
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"AdamW got lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}; "
                "lr, eps and weight_decay must be >= 0 and betas in [0, 1)"
            )
        if nonfinite not in (None, "raise", "skip"):
            raise ValueError(f"AdamW got nonfinite={nonfinite!r}; use 'raise', 'skip' or None (by dtype)")
        self.nonfinite = nonfinite
        self.edits_after_backward = bool(edits_after_backward)
        self.last_step_skipped = False
        # the loss scale this step's gradients carry, announced by GradScaler.unscale_ (clip_grad_norm_ divides
        # norms by it; the gradients themselves keep it until the fused update divides it out)
        self.carried_scale: float | None = None
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.param_groups[:] = [_Group(self, g) for g in self.param_groups]
        self._inner: dict[tuple[int, int], torch.optim.AdamW | None] = {}
        self._plain: torch.optim.AdamW | None = None
        self._loaded: dict[int, dict] = {}  # id(param) -> state from load_state_dict, not yet placed
        # (id(manager), chunk) -> what its last update changed, as it was (`_snapshot`): a buffer of its fp32 master
        # and AdamW states, and each view's `step` (None: it had no state)
        self._snapshots: dict[tuple[int, int], tuple[torch.Tensor, dict]] = {}
        self._lock = threading.Lock()
        # (checked before any parameter is marked as this one's, so that an error leaves them as they were)
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            _check_no_other_owner(p)
        for manager in self._managers():  # chunks built before the optimizer (protrain_fx.prepare, an earlier one)
            manager.check_model_params()  # (a weight tied since the chunks were built: an error now, not at the step)
        me = weakref.ref(self)
        for p in params:
            p.__dict__[OPTIMIZER_ATTR] = me
            # Dynamo's DDPOptimizer does not split a graph inside DDP's forward at buckets of it: its chunks
            # reduce its gradient (runtime/adopt.py, `pass_through_ddp`)
            p._ddp_ignored = True
        for manager in self._managers():
            manager.owners.forget()
            manager.owners.check()  # (a chunk stepped by two optimizers is an error now, not at the step)
        accept_in_accelerate()  # (a Trainer built next may compile with torch_compile_backend="protrain")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_inner"):  # (torch's __init__ adds the first groups)
            self.param_groups[-1] = _Group(self, self.param_groups[-1])

    def hyperparameter_set(self, key: str) -> None:
        """A param group's `key` was set (a scheduler, a manual warmup): between backward() and step() that is a
        change the step's updates must see (`ChunkManager.note_hyperparameter_set`)."""
        for manager in self._managers():
            manager.note_hyperparameter_set(self, key)

    def hyperparameters(self) -> list[dict]:
        """Each param group's hyperparameters as of now, as plain numbers: what a chunk's update uses."""
        return [{k: _number(g[k]) for k in _HYPER} for g in self.param_groups]

    # torch.amp.GradScaler hands a fused optimizer its scale and inf flag as attributes (`grad_scale`, `found_inf`)
    # for step() to apply, instead of unscaling `param.grad`: so does this one
    _step_supports_amp_scaling = True

    def _group_index(self) -> dict[int, int]:
        return {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}

    def _managers(self) -> list:
        seen: dict[int, object] = {}
        for group in self.param_groups:
            for p in group["params"]:
                m = p.__dict__.get(MANAGER_ATTR)
                if m is not None:
                    seen[id(m)] = m
        return list(seen.values())

    def _inner_for(self, manager, chunk: int) -> torch.optim.AdamW | None:
        """None when this rank's piece of the chunk is all padding."""
        key = (id(manager), chunk)
        with self._lock:
            if key not in self._inner:
                self._inner[key] = self._build_inner(manager, chunk)
            return self._inner[key]

    def _build_inner(self, manager, chunk: int) -> torch.optim.AdamW | None:
        groups: dict[int, list[torch.Tensor]] = {}
        index = self._group_index()
        master = manager.storage.master[chunk]
        pieces = manager.storage.param_pieces(chunk)
        views_in_order = []
        for i, start, end, _ in pieces:
            view = master[start:end]
            groups.setdefault(index[id(manager.params[i])], []).append(view)
            views_in_order.append(view)
        if not groups:
            return None
        inner = self._make_inner(
            groups,
            {id(v): manager.params[i] for v, (i, _, _, _) in zip(views_in_order, pieces)},
            {id(v): (begin, begin + v.numel()) for v, (_, _, _, begin) in zip(views_in_order, pieces)},
        )
        # where in the chunk's gradient each tensor's is; the views of it, made for the gradient tensor the chunk
        # holds (a shared host gradient shard changes from step to step: runtime/chunks/slots.py)
        inner.grad_range = {id(v): (start, end) for v, (_, start, end, _) in zip(views_in_order, pieces)}
        inner.grad_of, inner.grads_from = {}, None
        return inner

    def let_go_of_grads(self, manager) -> None:
        """The inner optimizers of `manager`'s chunks hold no gradient: `place_again` builds the gradient buffers
        anew, and a chunk's own buffer (its parameters' `.grad` here between updates) would outlive the switch."""
        for (owner, _), inner in self._inner.items():
            if owner == id(manager) and inner is not None:
                for view in (v for group in inner.param_groups for v in group["params"]):
                    view.grad = None
                inner.grad_of, inner.grads_from = {}, None

    def _make_inner(
        self,
        groups: dict[int, list[torch.Tensor]],
        param_of: dict[int, nn.Parameter],
        range_of: dict[int, tuple[int, int]] | None = None,
    ) -> torch.optim.AdamW:
        """A fused torch AdamW over `groups` (outer group index -> tensors), with any loaded state placed.
        `range_of`: the elements of its parameter (flattened) each tensor is; default all of them."""
        inner = torch.optim.AdamW(
            [{"params": tensors, **{k: self.param_groups[g][k] for k in _HYPER}} for g, tensors in groups.items()],
            fused=True,
        )
        inner.outer_groups = list(groups)
        inner.param_of = param_of
        inner.range_of = range_of or {i: (0, p.numel()) for i, p in param_of.items()}
        self._place_loaded(inner)
        return inner

    def _sync_hyper(self, inner: torch.optim.AdamW, hyper: list[dict] | None = None) -> None:
        """Copy the outer groups' hyperparameters (changed by schedulers), or `hyper`, into an inner optimizer."""
        for group, g in zip(inner.param_groups, inner.outer_groups):
            group.update({k: self.param_groups[g][k] for k in _HYPER} if hyper is None else hyper[g])

    def chunk_update(
        self,
        manager,
        chunk: int,
        grad_scale: float | None = None,
        found_inf: torch.Tensor | None = None,
        *,
        snapshot: bool = False,
        hyper: list[dict] | None = None,
    ) -> Callable[[], None]:
        """The update of one chunk piece as a function to run later (the manager runs it on its worker thread
        for offloaded chunks), with the hyperparameters (`hyper`, default those of now) and the set of parameters
        with a gradient as of now: a scheduler step or zero_grad() before it runs does not change it. `grad_scale`:
        the loss scale the gradients carry, divided out by the fused kernel. `found_inf`: a flag on the piece's
        device; the fused kernel skips the update (and keeps `step`) when it is set by the time the update runs.
        `snapshot`: keep the master and states as they were, for `restore`."""
        hyper = self.hyperparameters() if hyper is None else hyper
        with_grad = {i for i, _, _, _ in manager.storage.param_pieces(chunk) if i in manager.step_grads.params}

        @torch.no_grad()
        def update() -> None:
            inner = self._inner_for(manager, chunk)
            if inner is not None:
                for group, g in zip(inner.param_groups, inner.outer_groups):
                    group.update(hyper[g])
                grad = manager.storage.grad[chunk]
                if inner.grads_from is not grad:
                    inner.grad_of = {i: grad[a:b] for i, (a, b) in inner.grad_range.items()}
                    inner.grads_from = grad
                for group in inner.param_groups:
                    for view in group["params"]:  # like torch's AdamW, a parameter without gradient is not updated
                        got_grad = manager.index[id(inner.param_of[id(view)])] in with_grad
                        view.grad = inner.grad_of[id(view)] if got_grad else None
                _set_grad_scale(inner, grad_scale, manager.storage.master[chunk].device, found_inf)
                if snapshot:
                    self._snapshot(manager, chunk, inner)
                inner.step()
                if manager.storage.grad_is_shared(chunk):  # (the buffer or shard is given back next)
                    for view in (v for group in inner.param_groups for v in group["params"]):
                        view.grad = None
                    inner.grad_of, inner.grads_from = {}, None
            manager.publish(chunk)

        return update

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | None = None):
        """Update every parameter. `grad_scale` (from `protrain_fx.amp.GradScaler.step`): the loss scale the
        gradients carry. If any gradient of the step, on any rank, is inf or NaN: with the `nonfinite` policy
        "skip", nothing is updated and `last_step_skipped` is True; with "raise", a FloatingPointError on
        every rank (the updates started during the backward skipped themselves where they saw it). A step whose
        backward ran out of GPU memory under on_oom="replan" (runtime/oom.py) is skipped the same way."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with as_plain():
            self._step(grad_scale)
        return loss

    def step_as_at_backward(self) -> None:
        """This step as the backward left it, where some of its updates ran during the backward and cannot be
        undone, and the loop drops its gradients before `step()` (`ChunkManager.keep_started_step`): the other chunks
        update too, from their gradients and with the hyperparameters of the backward, whatever `.grad` and the
        param groups say now."""
        with as_plain():
            self._step(None, as_at_backward=True)

    def _step(self, grad_scale: float | None, *, as_at_backward: bool = False) -> None:
        managers = self._managers()
        self.last_step_skipped = False
        self.carried_scale = None
        if any(m.step_state.lost for m in managers):
            for manager in managers:
                manager.drop_all_grads()
                manager.step_state.skipped()
            self.last_step_skipped = True
            log.warning("a backward ran out of GPU memory and was re-planned: optimizer step skipped")
            return
        if grad_scale is not None and any(not m.edits.loss_scaled for m in managers):
            raise ValueError(
                "loss scaling (protrain_fx.amp.GradScaler) is for float16 models; this model's chunks are "
                f"{managers[0].dtype}, which trains without it: call optimizer.step() directly"
            )
        torch_scaled = isinstance(getattr(self, "found_inf", None), torch.Tensor)  # (torch.amp.GradScaler's step)
        if torch_scaled:
            scale = getattr(self, "grad_scale", None)
            grad_scale = None if scale is None else float(scale)
        hyper = self.hyperparameters()
        # the hyperparameters of the backward, where updates that cannot be undone started with them
        kept = next((h for m in managers if (h := m.started_with(self)) is not None), None)
        if kept == hyper and not as_at_backward:
            kept = None
        for manager in managers:
            manager.finish_reduction()  # (the step's last backward ran inside no_sync)
            if torch_scaled:
                manager.edits.scale_losses("torch.amp.GradScaler's loss scaling")
            if not as_at_backward:
                manager.reconcile_all()
            manager.fold_plain_grads()
            if kept is None:
                manager.check_hyperparameters(self, hyper)
            else:
                manager.edits.note_edit("hyperparameters (lr, betas, eps, weight_decay) set after the backward")
        found = self._found_inf(managers) or (torch_scaled and bool(self.found_inf.sum().item()))
        if found:
            for manager in managers:
                manager.end_step(self)
            skip = torch_scaled or any(skips_nonfinite(self, m.dtype) for m in managers)
            if not skip:
                raise FloatingPointError(
                    "a gradient of this step is inf or NaN (on this rank or another): training stopped before the "
                    "optimizer applied it; no weight or optimizer state holds inf or NaN (the chunk updates that "
                    "had started during the backward skipped themselves where they saw it, the others ran). "
                    "Check the loss and the data, lower the learning rate or clip gradients, and resume from "
                    "the last checkpoint; or skip such steps with protrain_fx.optim.AdamW(..., nonfinite='skip')"
                )
            self.last_step_skipped = True
            log.warning("a gradient is inf or NaN: optimizer step skipped on every rank (loss scale %s)", grad_scale)
            return
        for manager in managers:
            for chunk in manager.unstepped(self):  # chunks not started during the backward
                update = self.chunk_update(manager, chunk, grad_scale, hyper=kept)
                manager.submit_update(chunk, update)
            manager.end_step(self)
        self._step_plain(grad_scale, kept)
        if kept is not None and not as_at_backward:
            raise RuntimeError(
                f"hyperparameters set after backward() ({_changed(kept, hyper)}) were not applied to this step: its "
                f"update had already run in part during backward(), {WHY_EARLY}, and cannot be redone. So this "
                "step was applied whole with the values of the backward (optimizer.step() is done: go on with "
                "zero_grad()), and the new values apply from the next step on. From the next step on updates wait "
                f"for optimizer.step(), so such a change applies to its own step exactly. {SAY_SO}"
            )

    def _found_inf(self, managers) -> bool:
        """Whether any gradient of this step, on any rank, is inf or NaN (one device sync)."""
        plain = [p.grad for g in self.param_groups for p in g["params"] if MANAGER_ATTR not in p.__dict__]
        plain = [g if g.dtype in (torch.float16, torch.float32) else g.float() for g in plain if g is not None]
        flags = [m.nonfinite.found for m in managers]
        if plain:
            found = torch.zeros(1, device=plain[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(plain, found, torch.ones(1, device=found.device))
            flags.append(found)
        if not flags:
            return False
        total = sum(f.to(flags[0].device) for f in flags)
        if managers and managers[0].world_size > 1:
            with across_ranks("the all-reduce of the step's inf/NaN flag"):
                dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return bool(total.item())

    def _plain_inner(self) -> torch.optim.AdamW | None:
        """The torch AdamW over the parameters no manager owns (None if there are none)."""
        if self._plain is None:
            groups = {
                i: [p for p in g["params"] if MANAGER_ATTR not in p.__dict__] for i, g in enumerate(self.param_groups)
            }
            groups = {i: ps for i, ps in groups.items() if ps}
            if groups:
                self._plain = self._make_inner(groups, {id(p): p for ps in groups.values() for p in ps})
        return self._plain

    def _step_plain(self, grad_scale: float | None = None, hyper: list[dict] | None = None) -> None:
        """Parameters no manager owns: a torch AdamW over them, kept in step with the param groups (or with
        `hyper`, the hyperparameters of the step's backward)."""
        if self._plain_inner() is None:
            return
        self._sync_hyper(self._plain, hyper)
        _set_grad_scale(self._plain, grad_scale, next(iter(self._plain.param_of.values())).device)
        self._plain.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: the parameters' `.grad` set to None (or zeroed); their chunks forget those gradients."""
        with as_plain():
            super().zero_grad(set_to_none=set_to_none)
            for manager in self._managers():
                manager.zero_grad()


def accept_in_accelerate() -> None:
    """accelerate, through which the Hugging Face Trainer compiles (`TrainingArguments(torch_compile_backend=...)`,
    `Accelerator(dynamo_backend=...)`), takes only the torch.compile backends its `DynamoBackend` enum lists, and
    hands torch.compile the value lowercased: "PROTRAIN" becomes one of its values, so that the Trainer compiles
    with backend="protrain" (found by its entry point). Where accelerate is imported already: when protrain_fx is,
    and when a protrain_fx.optim.AdamW is built (the Trainer recipe builds it before the Trainer); it is not
    imported for this."""
    module = sys.modules.get("accelerate.utils.dataclasses")
    backends = getattr(module, "DynamoBackend", None)
    if backends is None or "PROTRAIN" in backends._value2member_map_:
        return
    member = str.__new__(backends, "PROTRAIN")
    member._name_ = member._value_ = "PROTRAIN"
    backends._value2member_map_["PROTRAIN"] = member  # (what `DynamoBackend("PROTRAIN")` looks up)


accept_in_accelerate()


def _check_no_other_owner(p: nn.Parameter) -> None:
    """A parameter is stepped by one protrain_fx.optim.AdamW at a time: a ValueError naming it (by its name in the
    model where it is in chunks) where another one, still alive once its host updates have ended, steps it."""
    ref = p.__dict__.get(OPTIMIZER_ATTR)
    if ref is None or ref() is None:
        return
    manager = p.__dict__.get(MANAGER_ATTR)
    if manager is not None:  # (a host update still running holds its optimizer until it ends)
        manager.wait_for_update()
    gc.collect()  # (and one dropped in a reference cycle goes with the collector only)
    if ref() is None:
        return
    which = repr(manager.slot_of(p).name) if manager is not None else f"of shape {tuple(p.shape)}"
    raise ValueError(
        f"parameter {which} is stepped by another protrain_fx.optim.AdamW already, which is still alive: something "
        "holds it (a variable, an lr scheduler built over it, a Trainer), and a parameter is stepped by one optimizer "
        "at a time. Drop the old optimizer and every object holding it (e.g. `del optimizer, scheduler`) before "
        "building this one, or go on with the old one (its param_groups, add_param_group, load_state_dict)"
    )


class _Group(dict):
    """A param group that tells its optimizer when a hyperparameter is set (schedulers and warmups set them)."""

    def __init__(self, optimizer: AdamW, group: dict):
        super().__init__(group)
        self._optimizer = weakref.ref(optimizer)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._tell(key)

    def update(self, *args, **kwargs) -> None:
        changed = dict(*args, **kwargs)
        super().update(changed)
        for key in changed:
            self._tell(key)

    def _tell(self, key) -> None:
        optimizer = self._optimizer()
        if key in _HYPER and optimizer is not None:
            optimizer.hyperparameter_set(key)

    def __reduce__(self):  # (copied and pickled as the plain dict torch's optimizers keep)
        return dict, (dict(self),)


def _changed(before: list[dict], now: list[dict]) -> str:
    """What differs between two lists of param groups' hyperparameters, e.g. "lr 0.01 -> 0.001"."""
    changes = [
        f"{'' if len(now) == 1 else f'group {g}: '}{k} {a[k]} -> {b[k]}"
        for g, (a, b) in enumerate(zip(before, now))
        for k in _HYPER
        if a[k] != b[k]
    ]
    return ", ".join(changes) or "the same values, set again"


def _number(value):
    """A hyperparameter as a plain number (a tensor lr, say, as a float; betas as a tuple of floats)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(_number(v) for v in value)
    return value


def _set_grad_scale(
    inner: torch.optim.AdamW, grad_scale: float | None, device: torch.device, found_inf: torch.Tensor | None = None
) -> None:
    """torch's fused AdamW divides the gradients by `inner.grad_scale` when set (as torch.amp.GradScaler does)
    and skips the update where `inner.found_inf` is set."""
    inner.grad_scale = None if grad_scale is None else torch.full((), grad_scale, device=device)
    if found_inf is None and grad_scale is not None:
        found_inf = torch.zeros((), device=device)
    inner.found_inf = found_inf
