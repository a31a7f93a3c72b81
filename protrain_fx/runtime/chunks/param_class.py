"""ChunkedParameter: the class a ChunkManager gives the parameters it holds, so that Python's calls on an offloaded
one, which holds no storage (`print(p)`, `p.norm()`, an EMA's `ema_p.lerp_(p, w)`, `nn.init.normal_(p)`), give eager
PyTorch's answers instead of reading freed memory.

A torch call made outside compiled code on an offloaded parameter, or on a tensor sharing its storage (`p.detach()`,
`p.data`, `p[0]`: a `ChunkedView`), runs on the parameter's current values:

    outside.lend([i])         its storage holds its values (a collective where its chunk is sharded, as a read of
                              a sharded `.grad` is); `outside`: the manager's part, runtime/chunks/outside.py
    out = func(...)
    outside.load_param(i, p)  where the call wrote into it (a version moved): its chunk takes the values
    outside.take_back([i])    its storage is emptied again; where autograd recorded the call (grad mode), it stays
                              lent until the step ends, as for a forward Python runs, and its chunk's updates wait
                              for the step (autograd may give it a gradient)
    out                       a tensor sharing its storage is a ChunkedView, whose calls lend it again

A foreach call (`torch._foreach_lerp_` over a model's parameters: EMAs, `AveragedModel`) runs position by position, so
that one parameter is lent at a time. `p.data = t` gives the parameter `t`'s values, which its chunk takes, as a write
into it does (the parameter stays in its chunk, so unlike eager's it does not share `t`'s storage); a `t` of another
shape, dtype or device is an error (`resize_token_embeddings` after the chunks are built). Other getters and setters
(`p.shape`, `p.grad`) and the calls that read no values (`READS_NO_VALUES`, protrain's own ops) run as on any
parameter: the runtime makes them on offloaded parameters itself (its own `p.data = ...`: `set_storage`). A user's
`p.grad = t` is told to the chunk first (`ChunkManager.setting_grad`: a step whose updates started in the backward
refuses a new gradient, and applies whole where its gradients are dropped).

`torch.autograd.grad(loss, params)` lends nothing (it reads no values of its inputs): their gradients are taken from
the compiled backward (runtime/grads.py: `autograd_grad`).

Compiled code never runs any of this: Dynamo traces a ChunkedParameter's calls as the plain parameter's
(`torch.compiler.is_compiling()`). Dynamo's guards check a parameter's class, so it is set before they are built: by
`protrain_fx.prepare` (before any trace), or in the first training graph's backend, before Dynamo builds that
frame's guards; a frame compiled earlier that reads the parameters (an inference graph) compiles once more.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from protrain_fx.runtime.chunks.common import MANAGER_ATTR
from protrain_fx.runtime.grads import autograd_grad

log = logging.getLogger(__name__)

VIEW_OF = "_protrain_view_of"  # on a ChunkedView: the parameter whose storage it shares
# calls that read no values: the runtime (and AOTAutograd's wrappers) make them on offloaded parameters
READS_NO_VALUES = frozenset(
    (
        "__get__",
        "__set__",
        "__delete__",
        "untyped_storage",
        "storage_offset",
        "numel",
        "nelement",
        "element_size",
        "dim",
        "ndimension",
        "size",
        "stride",
        "is_contiguous",
        "data_ptr",
        "get_device",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "_is_view",
        "__len__",
        "is_inference",
        "is_pinned",
        "is_shared",
        "is_conj",
        "is_neg",
        "_is_zerotensor",
        "has_names",
        "dim_order",
        "_typed_storage",
        "storage",
        "_view_func",
        "_view_func_unsafe",
        "_rev_view_func_unsafe",
        "is_set_to",
        "_fix_weakref",
    )
)
# torch's tracing modes (a compile fakifying the parameters): their calls read no values either
_TRACING_MODES = (
    torch._C._TorchDispatchModeKey.FAKE,
    torch._C._TorchDispatchModeKey.PROXY,
    torch._C._TorchDispatchModeKey.FUNCTIONAL,
)
# calls whose result shares memory beyond torch's views (a NumPy array, a pickled view's storage): run on a copy
_COPIED = frozenset(("numpy", "__array__", "__reduce_ex__"))
_SET_DATA = torch.Tensor.data.__set__  # `p.data = t`, as `__torch_function__` sees it
_SET_GRAD = torch.Tensor.grad.__set__  # `p.grad = t`


def as_plain() -> contextlib.AbstractContextManager[None]:
    """The runtime's own calls on chunked parameters (its optimizer, its gradient reductions, its copies in and out
    of the chunks): subclass dispatch off, so that they run as on plain parameters, not through `_torch_function`."""
    return torch._C.DisableTorchFunctionSubclass()


def set_storage(p: nn.Parameter, t: torch.Tensor) -> None:
    """The runtime's own `p.data = t` (a view of the parameter's chunk, or an empty tensor), not a user's."""
    with as_plain():
        p.data = t


def adopt(p: nn.Parameter) -> None:
    """`p` (held by a ChunkManager now) becomes a ChunkedParameter; a parameter of another subclass keeps its class."""
    if type(p) is nn.Parameter:
        p.__class__ = ChunkedParameter


@torch.compiler.disable  # (Python calls it where Dynamo is on, after a graph break: the runtime stays Python)
def _torch_function(func, args: tuple, kwargs: dict | None) -> Any:
    kwargs = kwargs or {}
    with as_plain():
        if (
            func == _SET_DATA
            and isinstance(args[0], ChunkedParameter)
            and not _tracing()
            and (of := _param_of(args[0]))
        ):
            return _set_data(*of, args[1])
        if func == _SET_GRAD and isinstance(args[0], ChunkedParameter) and not _tracing():
            _setting_grad(args[0], args[1])
        if func is torch.autograd.grad:  # (it reads no values of the inputs: their gradients come from the chunks)
            return autograd_grad(args, kwargs or {}, _chunk_key)
        if _reads_no_values(func):
            return _views_kept(func(*args, **kwargs), args)
        found = _chunked(args, kwargs)
        if not found:
            return _call(func, args, kwargs)
        if _is_foreach(func) and len(found) > 1:
            return _one_by_one(func, args, kwargs)
        return _call_lent(func, args, kwargs, found)


def _run_in_python(cls: type) -> type:
    """Dynamo runs the class's `__torch_function__` as Python wherever Python calls it, instead of compiling its
    frame on its own (where `is_compiling()` would be True); traced from compiled code, it is inlined as usual."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(cls.__dict__["__torch_function__"].__func__.__code__)
    return cls


@_run_in_python
class ChunkedParameter(nn.Parameter):
    """A parameter a ChunkManager holds (module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():  # (traced by Dynamo: the plain parameter's call)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return _torch_function(func, args, kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        """A plain parameter of its current values, as eager's copy is (not a part of the chunks)."""
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.detach().clone(), self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, protocol: int):
        """Pickled (`torch.save(p)`) as a plain parameter of its current values, without protrain's state."""
        return torch._utils._rebuild_parameter, (self.detach().clone(), self.requires_grad, collections.OrderedDict())


@_run_in_python
class ChunkedView(torch.Tensor):
    """A tensor sharing a ChunkedParameter's storage (module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return _torch_function(func, args, kwargs)


def _reads_no_values(func) -> bool:
    if getattr(func, "__name__", None) in READS_NO_VALUES:
        return True
    packet = getattr(func, "overloadpacket", func)  # (protrain's own ops: the runtime's)
    if str(getattr(packet, "_qualified_op_name", "")).startswith("protrain::"):
        return True
    return _tracing()


def _tracing() -> bool:
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


def _set_data(p: nn.Parameter, state: str, t: Any) -> None:
    """A user's `p.data = t` (module docstring) on `p` in `state` (`_param_of`): `t`'s values copied into the
    parameter, and so into its chunk."""
    if not isinstance(t, torch.Tensor):
        return _SET_DATA(p, t)  # (torch's TypeError)
    if t is p or (_storage(t), t.storage_offset(), t.stride()) == (_storage(p), p.storage_offset(), p.stride()):
        return None  # (the same memory: `module.to()` changing nothing sets `p.data = p`)
    if (t.shape, t.dtype, t.device) != (p.shape, p.dtype, p.device):
        raise ValueError(
            f"{_name(p)!r} lives in protrain chunks as a {tuple(p.shape)} {p.dtype} tensor on {p.device}: "
            f"`.data = ` cannot make it a {tuple(t.shape)} {t.dtype} tensor on {t.device} once the chunks are built "
            "(at the model's first compiled training step, or by protrain_fx.prepare). Resize, cast or move the "
            "model (resize_token_embeddings, .to()) before that; to set its values, assign a tensor of its shape, "
            "dtype and device, or copy into it (p.copy_(t) under torch.no_grad())"
        )
    with torch.no_grad():
        found = _chunked((p, t), {})
        found.setdefault(id(p), (p, state, [p]))  # (a persistent one too: its master takes the values)
        _call_lent(torch.Tensor.copy_, (p, t), {}, found)
    return None


def _setting_grad(p: nn.Parameter, value: Any) -> None:
    """A user's `p.grad = value`: its chunk hears of it now (`ChunkManager.setting_grad`), which may refuse it."""
    manager = p.__dict__.get(MANAGER_ATTR)
    if manager is not None and manager.holds(p):
        manager.setting_grad(manager.index[id(p)], value)


def _chunk_key(t: Any) -> tuple[int, int] | None:
    """(its manager's handle, its index there) of a parameter held in chunks; None for any other tensor."""
    manager = t.__dict__.get(MANAGER_ATTR) if isinstance(t, ChunkedParameter) else None
    return (manager.handle, manager.index[id(t)]) if manager is not None and manager.holds(t) else None


def _is_foreach(func) -> bool:
    return getattr(func, "__name__", "").startswith("_foreach_")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _param_of(t: Any) -> tuple[nn.Parameter, str] | None:
    """(the ChunkedParameter `t` is or shares the storage of, its state: "freed" (offloaded, holding no values),
    "lent" (offloaded, holding them) or "persistent"); None where `t` is neither."""
    if isinstance(t, ChunkedParameter):
        manager = t.__dict__.get(MANAGER_ATTR)
        if manager is None:  # (a copy: copy.deepcopy(p))
            return None
        p = t
    elif isinstance(t, ChunkedView):
        p = t.__dict__[VIEW_OF]
        manager = p.__dict__[MANAGER_ATTR]
        if _storage(p) != _storage(t):  # (the parameter's storage was replaced: its chunk moved)
            raise ValueError(
                f"a tensor taken from parameter {_name(p)!r} (p.detach(), p.data, a view of it) before protrain moved "
                "its chunk reads memory protrain freed: take it from the parameter again"
            )
    else:
        return None
    if manager.is_persistent(p):
        return p, "persistent"
    return p, "freed" if _holds_none(t) else "lent"


def _holds_none(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0 and t.numel() > 0


def _name(p: nn.Parameter) -> str:
    manager = p.__dict__[MANAGER_ATTR]
    return manager.slots[manager.index[id(p)]].name


def _chunked(args: tuple, kwargs: dict) -> dict[int, tuple[nn.Parameter, str, list[torch.Tensor]]]:
    """id(parameter) -> (a ChunkedParameter the call must see to, its state (`_param_of`), the arguments that are it
    or share its storage): the offloaded ones, and under grad mode the persistent ones that require grad (autograd
    gives them a gradient outside the graphs: their chunks' updates wait for the step)."""
    found: dict[int, tuple[nn.Parameter, str, list[torch.Tensor]]] = {}
    for t in pytree.tree_leaves((args, kwargs)):
        of = _param_of(t)
        if of is None or (of[1] == "persistent" and not (torch.is_grad_enabled() and of[0].requires_grad)):
            continue
        found.setdefault(id(of[0]), (*of, []))[2].append(t)
    return found


def _call_lent(func, args: tuple, kwargs: dict, found: dict) -> Any:
    """`func` run with the offloaded parameters among its arguments lent their values where they hold none, and
    what it writes into them taken into their chunks (module docstring)."""
    name = getattr(func, "__name__", None)
    if name == "__dlpack__":
        raise TypeError("DLPack of an offloaded parameter would share memory protrain frees: copy it first (p.clone())")
    seen: dict[int, tuple[Any, list[int], list[int]]] = {}  # id(manager) -> (it, the parameters lent, all)
    for p, state, _ in found.values():
        manager = p.__dict__[MANAGER_ATTR]
        entry = seen.setdefault(id(manager), (manager, [], []))
        entry[2].append(manager.index[id(p)])
        if state == "freed":
            entry[1].append(manager.index[id(p)])
    versions = {id(t): t._version for _, _, ts in found.values() for t in ts}
    for manager, lent, _ in seen.values():
        if lent:
            log.debug("parameters %s lent to a Python call of %s", [manager.slots[i].name for i in lent], func)
            manager.outside.lend(lent, for_backward=False)
    if name in _COPIED:  # (what it gives shares memory beyond torch's views: a copy's, read-only)
        args = (args[0].clone(), *args[1:])
    try:
        out = _call(func, args, kwargs)
        for p, _, ts in found.values():
            if any(t._version != versions[id(t)] for t in ts):  # (written into: its chunk takes the values)
                manager = p.__dict__[MANAGER_ATTR]
                manager.outside.load_param(manager.index[id(p)], p)
        if name in ("numpy", "__array__"):
            out.flags.writeable = False
        if torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(out)):
            for manager, _, indices in seen.values():
                _read_by_autograd(manager, indices, func)
        return _views_kept(out, [p for p, _, _ in found.values()])
    finally:
        for manager, lent, _ in seen.values():
            manager.outside.take_back(lent)


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _read_by_autograd(manager, indices: list[int], func) -> None:
    """A call under grad mode recorded these parameters for autograd, which may give them a gradient outside the
    graphs: the offloaded ones stay lent until the step ends, and their chunks' updates wait for the step."""
    waiting = set(manager.eager_chunks)
    manager.outside.lend(indices, for_backward=True)
    if manager.eager_chunks - waiting:
        log.info(
            "chunks %s update in optimizer.step() from now on, not during the backward: a Python call of %s under "
            "grad mode read their parameters (autograd may give them gradients); read them under torch.no_grad() "
            "where it does not",
            sorted(manager.eager_chunks - waiting),
            getattr(func, "__name__", func),
        )


def _call(func, args: tuple, kwargs: dict) -> Any:
    """`func(*args, **kwargs)`; a repr is eager's ("tensor(...)", not the subclass's name)."""
    if func is not torch.Tensor.__repr__:
        return func(*args, **kwargs)
    t, cls = args[0], type(args[0])
    t.__class__ = nn.Parameter if isinstance(t, nn.Parameter) else torch.Tensor
    try:
        return func(*args, **kwargs)
    finally:
        t.__class__ = cls


def _views_kept(out: Any, sources: Any) -> Any:
    """`out`, where a plain tensor in it shares the storage of a ChunkedParameter or ChunkedView among `sources`
    (leaves), as a ChunkedView of that parameter."""
    if isinstance(out, torch.Size) or not isinstance(out, (torch.Tensor, tuple, list)):
        return out  # (most getters: `p.shape`, a number)
    plain = [t for t in pytree.tree_leaves(out) if type(t) is torch.Tensor]
    if not plain:  # (`p.grad`: a ChunkGrad)
        return out
    shared = {}
    for s in pytree.tree_leaves(sources):
        if isinstance(s, ChunkedParameter) and MANAGER_ATTR in s.__dict__:
            shared[_storage(s)] = s
        elif isinstance(s, ChunkedView):
            shared[_storage(s)] = s.__dict__[VIEW_OF]
    if not shared:
        return out
    for t in plain:
        if (p := shared.get(_storage(t))) is not None:
            t.__class__ = ChunkedView
            t.__dict__[VIEW_OF] = p
    return out


def _one_by_one(func, args: tuple, kwargs: dict) -> Any:
    """A foreach call run one list position at a time (each position's own call lends its parameters)."""
    n = len(next(a for a in args if isinstance(a, (list, tuple))))
    outs = []
    for k in range(n):
        at = [a[k : k + 1] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args]
        found = _chunked(tuple(at), kwargs)
        outs.append(_call_lent(func, tuple(at), kwargs, found) if found else func(*at, **kwargs))
    return None if all(o is None for o in outs) else [t for o in outs for t in o]
