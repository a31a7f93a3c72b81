"""`param.grad` of chunked parameters: the gradient the optimizer will use, where torch's loops look for it.

A chunked parameter's gradient lives in its chunk (runtime/chunks/): a slice of the chunk's gradient in the
master dtype, on the device or in this rank's host shard. After a backward, `param.grad` of every parameter
that got a gradient is a `ChunkGrad`: a tensor with the parameter's shape, dtype and device (what `.grad`
must have) whose ops run on that slice, so `torch.nn.utils.clip_grad_norm_`, `clip_grad_value_`,
`torch.amp.GradScaler`, gradient-norm logging and `p.grad is None` checks give eager PyTorch's answers:

- reads (norms, `.cpu()`, `.clone()`, `.sum()`, ...): on the gradient's values, copied out in the parameter's
  dtype on its device. A sharded gradient is gathered across ranks for them (a collective, as DTensor's
  `full_tensor()`), but for its vector norm, which combines each rank's part.
- in-place writes (`mul_`, `clamp_`, `copy_`, `add_`, the unscale of `GradScaler`, ...): on the slice
  itself, in the master dtype, where it lives (`ParamGrads.write`). A write multiplying by exactly 1 (what
  `clip_grad_norm_` does when the norm is under its limit) changes nothing and is skipped.
- `zero_()` (what `zero_grad(set_to_none=False)` does) drops the parameter's gradient from its chunk; the
  `ChunkGrad` stays and reads as zeros.

`torch.autograd.grad(loss, params)` over chunked parameters returns their gradients as eager's does, and leaves
`.grad`, the chunks and the optimizer alone (`autograd_grad`): the compiled backward hands a chunk's gradients to
`protrain::reduce_grads`, which a dispatch mode around that backward takes them from instead (`_Taken`).

`param.grad = None` (what `zero_grad()` of the model, of a module or of any optimizer does) drops it too, and a
plain tensor put in `param.grad` (by autograd, for a use outside the compiled graphs, or by the user) is that
parameter's gradient: `ParamGrads.reconcile` and `fold_strays` take both into the chunk before its gradient is
next added to, read or stepped.

A chunk's update may start during the backward (runtime/chunks/updates.py). Its gradient is then spoken for: a write
to it, or dropping it, undoes the update where a copy of what it changed was kept (`speculates`); otherwise a write
to a gradient of that optimizer is refused with an error (`refuse_edit`) and dropping one applies the step whole
before the error (`keep_started_step`). From the first step that writes to gradients between `backward()` and
`optimizer.step()`, updates wait for the step, as with clipping (`ChunkManager.edits`: runtime/chunks/edits.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from protrain_fx.runtime.chunks import ChunkManager

log = logging.getLogger(__name__)

aten = torch.ops.aten
_ALIASES = {aten.detach.default, aten.alias.default}
_NORMS = {aten.linalg_vector_norm.default, aten.norm.Scalar}
_SCALINGS = {aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar}


class ChunkGrad(torch.Tensor):
    """`param.grad` of a chunked parameter (see the module docstring)."""

    grads: ParamGrads
    index: int  # the parameter's index in its ChunkManager

    @staticmethod
    def __new__(cls, grads: ParamGrads, index: int) -> ChunkGrad:
        p = grads.param(index)
        t = torch.Tensor._make_wrapper_subclass(cls, p.shape, dtype=p.dtype, device=p.device)
        t.grads, t.index = grads, index
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ChunkGrad(of {self.grads.name(self.index)!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None  # (the common case: torch's loops call one op per gradient)
        if not isinstance(first, ChunkGrad):
            first = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, ChunkGrad))
        return first.grads.run(func, args, kwargs)


def _writes_first(func) -> bool:
    arguments = func._schema.arguments
    alias = arguments[0].alias_info if arguments else None
    return alias is not None and alias.is_write


@functools.cache
def _kind(func) -> str:
    """How `ParamGrads.run` treats an op (read from its schema once: a clip runs two ops per gradient)."""
    if func in _ALIASES:
        return "alias"
    if func is aten.detach_.default:
        return "detach_"
    name = func._schema.name
    if name.startswith("aten::_foreach_") or name == "aten::_amp_foreach_non_finite_check_and_unscale_":
        return "foreach"
    if func in _NORMS:
        return "norm"
    return "write" if _writes_first(func) else "read"


def _foreach_lists(args: Sequence[Any]) -> list[int]:
    """Positions of the list arguments of a foreach op (its tensor lists and scalar lists)."""
    return [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]


class ParamGrads:
    """The `param.grad` side of one ChunkManager: hands out `ChunkGrad`s and runs their ops (module docstring)."""

    def __init__(self, manager: ChunkManager):
        self._manager = weakref.ref(manager)
        # the last 0-dim scaling factor read (`_is_one`): a weak reference, its version counter, whether it is 1
        self._last_factor: tuple[Callable[[], Any], int, bool] = (lambda: None, -1, False)

    @property
    def manager(self) -> ChunkManager:
        manager = self._manager()
        assert manager is not None, "a ChunkGrad outlived its ChunkManager"
        return manager

    def param(self, index: int) -> nn.Parameter:
        return self.manager.params[index]

    def name(self, index: int) -> str:
        return self.manager.slots[index].name

    def mine(self, t: Any) -> bool:
        return isinstance(t, ChunkGrad) and t.grads is self

    def publish(self, indices: Sequence[int]) -> None:
        """The parameters got a gradient in their chunk: their `.grad` reads it."""
        for i in indices:
            p = self.param(i)
            if not self.mine(p.grad):
                p.grad = ChunkGrad(self, i)

    # ----- what the user did to .grad since the chunk last saw it ---------------------------------------------

    def take_plain(self, index: int) -> torch.Tensor | None:
        """A plain tensor in the parameter's `.grad` (autograd's, for a use outside the compiled graphs, or the
        user's): its gradient, to add into the chunk; `.grad` reads the chunk from now on."""
        p = self.param(index)
        if p.grad is None or isinstance(p.grad, ChunkGrad):
            return None
        plain = p.grad.detach()
        p.grad = ChunkGrad(self, index)
        return plain

    def cleared(self, index: int) -> bool:
        """Whether the parameter's gradient was dropped by the user since its chunk took it (`.grad` set to None
        or replaced)."""
        return not self.mine(self.param(index).grad)

    # ----- ops on ChunkGrads ------------------------------------------------------------------------------

    def run(self, func, args: tuple, kwargs: dict) -> Any:
        kind = _kind(func)
        if kind == "alias":
            return ChunkGrad(self, args[0].index)
        if kind == "detach_":
            return args[0]
        if kind == "foreach":
            return self._foreach(func, args, kwargs)
        first = args[0] if args else None
        if kind == "norm" and self.mine(first):  # (one per gradient in a norm loop: no tree walk)
            if self.manager.grad_is_sharded(first.index):
                return self._sharded_norm(func, args, kwargs)
            return func(self.dense(first.index), *args[1:], **kwargs)
        if kind == "write" and self.mine(first):
            return self.write(func, args, kwargs)
        dense = pytree.tree_map(lambda t: self.dense(t.index) if self.mine(t) else t, (args, kwargs))
        return func(*dense[0], **dense[1])

    def dense(self, index: int) -> torch.Tensor:
        """The parameter's gradient, whole, in its dtype on its device (a copy)."""
        p = self.param(index)
        manager = self.manager
        piece = manager.grad_piece(index)
        if piece is None:
            return torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        if manager.grad_is_sharded(index):
            return manager.gather_param_grad(index, piece).to(p.device, p.dtype).view(p.shape)
        return piece.to(p.device, p.dtype, copy=True).view(p.shape)

    def write(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """An in-place op on a ChunkGrad: run on the chunk's slice (see the module docstring)."""
        target: ChunkGrad = args[0]
        manager = self.manager
        if func in _SCALINGS and self._is_one(args[1]):
            return target
        if func is aten.zero_.default:
            manager.drop_grad(target.index, "zero_()")
            return target
        piece = manager.editable_grad(target.index, func._schema.name, create=func not in _SCALINGS)
        if piece is None:
            return target  # (a scaled zero is zero)
        sharded = manager.grad_is_sharded(target.index)
        lo, hi = manager.local_range(target.index)

        def local(t: Any) -> Any:
            if self.mine(t):
                t = self.dense(t.index)
            if not isinstance(t, torch.Tensor):
                return t
            if t.dim() and t.numel() == target.numel():  # a whole gradient: its part here
                t = t.reshape(-1)[lo:hi] if sharded else t.reshape(piece.shape)
            return t.to(piece.device)

        if func in _SCALINGS and not kwargs:  # (one per gradient in a clip loop: no tree walk)
            func(piece, local(args[1]))
            return target
        rest = pytree.tree_map(local, (args[1:], kwargs))
        func(piece, *rest[0], **rest[1])
        return target

    def _is_one(self, factor: Any) -> bool:
        """Whether a scaling factor is exactly 1. A 0-dim tensor is read once while it is unchanged: torch's clip
        scales every gradient by one coefficient tensor, and a read per gradient would sync the device each time."""
        if not isinstance(factor, torch.Tensor):
            return isinstance(factor, (int, float)) and factor == 1
        if factor.numel() != 1:
            return False
        known, version, value = self._last_factor
        if known() is not factor or version != factor._version:
            value = bool(factor.detach().cpu() == 1)
            self._last_factor = (weakref.ref(factor), factor._version, value)
        return value

    def _foreach(self, func, args: tuple, kwargs: dict) -> Any:
        """A foreach op over a list holding ChunkGrads: each ChunkGrad by the op's single-tensor form (which
        dispatches back here), then the plain tensors in one foreach call (a write a ChunkGrad refuses, a clip after
        updates started, leaves them unchanged too)."""
        lists = _foreach_lists(args)
        tensors = args[lists[0]]
        mine = [i for i, t in enumerate(tensors) if self.mine(t)]
        plain = [i for i in range(len(tensors)) if i not in mine]
        results: list[Any] = [None] * len(tensors)
        for i in mine:
            results[i] = self._foreach_one(func, [args[k][i] if k in lists else a for k, a in enumerate(args)], kwargs)
        if plain:
            sub = [[a[i] for i in plain] if k in lists else a for k, a in enumerate(args)]
            out = func(*sub, **kwargs)
            for i, r in zip(plain, out or [None] * len(plain)):
                results[i] = r
        return None if func._schema.returns == [] or _writes_first(func) else results

    def _foreach_one(self, func, args: list, kwargs: dict) -> Any:
        name = func._schema.name
        t = args[0]
        if name == "aten::_amp_foreach_non_finite_check_and_unscale_":
            found_inf, inv_scale = args[1], args[2]
            values = self.dense(t.index)
            found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(values).all()).to(found_inf)))
            t.mul_(inv_scale)
            return None
        if name == "aten::_foreach_norm":
            return torch.linalg.vector_norm(t, *args[1:2], dtype=kwargs.get("dtype"))
        method = getattr(torch.Tensor, name.removeprefix("aten::_foreach_"))
        return method(t, *args[1:], **kwargs)

    def _sharded_norm(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """The vector norm of a sharded gradient: each rank's part, combined across ranks (a collective)."""
        target: ChunkGrad = args[0]
        ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2)))
        dims = args[2] if len(args) > 2 else kwargs.get("dim")
        if dims not in (None, [], ()):
            dense = self.dense(target.index)
            return func(dense, *args[1:], **kwargs)
        manager = self.manager
        piece = manager.grad_piece(target.index)
        local = torch.full((), math.inf if ord_ == -math.inf else 0.0, dtype=torch.float64, device=manager.device)
        if piece is not None and piece.numel():
            part = torch.linalg.vector_norm(piece.to(manager.device, target.dtype), ord_).double()
            local = part if math.isinf(ord_) else part.pow(ord_) if ord_ else part
        op = dist.ReduceOp.MAX if ord_ == math.inf else dist.ReduceOp.MIN if ord_ == -math.inf else dist.ReduceOp.SUM
        manager.all_reduce(local, op, "the all-reduce of a gradient's norm")
        total = local if math.isinf(ord_) or not ord_ else local.pow(1 / ord_)
        like = func(torch.empty(target.shape, dtype=target.dtype, device="meta"), *args[1:], **kwargs)
        return total.to(target.device, like.dtype)


_GRAD_SIGNATURE = inspect.signature(torch.autograd.grad)


class _Taken(TorchDispatchMode):
    """Around a backward run by `torch.autograd.grad`: the gradients the compiled graphs hand to their chunks
    (`protrain::reduce_grads`) are kept here, by (manager handle, parameter index), and the chunks never see them
    (no reduction, no optimizer update). A parameter whose gradients come from several graphs gets their sum."""

    def __init__(self):
        super().__init__()
        self.grads: dict[tuple[int, int], torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name != "protrain::reduce_grads":
            return func(*args, **(kwargs or {}))
        manager, _, _, indices, grads, _ = args
        for i, g in zip(indices, grads):
            key = (manager, i)
            # (a copy: inductor may reuse a gradient's memory once the op that took it returns)
            self.grads[key] = g.detach().clone() if key not in self.grads else self.grads[key] + g
        return None


def autograd_grad(args: tuple, kwargs: dict, chunk_of: Callable[[Any], tuple[int, int] | None]) -> Any:
    """`torch.autograd.grad(*args, **kwargs)` where some `inputs` are chunked parameters (`chunk_of(t)`: their
    (manager handle, index), else None): their gradients as eager's `autograd.grad` gives them, in their dtype on
    their device, taken from the compiled backward (`_Taken`) plus any autograd gives them directly (a use outside
    the compiled graphs); `.grad`, the chunks and the optimizer are left as they were."""
    bound = _GRAD_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    if call["create_graph"] or call["is_grads_batched"]:
        raise ValueError(
            "torch.autograd.grad(..., create_graph=True or is_grads_batched=True) over parameters held in protrain "
            "chunks: their gradients come from the compiled backward, which has no backward of its own; take "
            "first-order gradients (the default), or loss.backward() and read each parameter's .grad"
        )
    tensors = list(call["inputs"])  # (torch.autograd.grad hands them on as a tuple, and makes a dict of what we return)
    allow_unused = call["materialize_grads"] if call["allow_unused"] is None else call["allow_unused"]
    taken = _Taken()
    with taken:
        found = torch.autograd.grad(
            call["outputs"],
            tensors,
            grad_outputs=call["grad_outputs"],
            retain_graph=call["retain_graph"],
            allow_unused=True,
        )
    out = []
    for k, (t, g) in enumerate(zip(tensors, found)):
        key = chunk_of(t)
        if key is not None and key in taken.grads:
            g = taken.grads[key].to(t.dtype) if g is None else g + taken.grads[key].to(g.dtype)
        if g is None and call["materialize_grads"]:
            g = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        if g is None and not allow_unused:
            raise RuntimeError(
                f"The differentiated Tensor at index {k} appears to not have been used in the graph. Set "
                "allow_unused=True if this is the desired behavior."
            )
        out.append(g)
    return tuple(out)
