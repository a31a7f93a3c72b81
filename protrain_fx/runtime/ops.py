"""The runtime ops the rewritten graphs call: `torch.library` custom ops with fake implementations.

    buf  = protrain.gather(manager, chunk, [tokens])           # chunk's parameters, whole, in a device buffer
    protrain.prefetch(manager, next_chunk, buf)                # start loading the next chunk on the copy stream
    w    = aten.view(aten.slice(buf, 0, offset, offset + numel), shape)   # a parameter, read from the buffer
    tok  = protrain.release(manager, chunk, [last users of the chunk])   # after its last use; the token orders
                                                               # the gathers after it (passes/chunks.py)
    protrain.materialize([y])                                  # y, a reader's output, computed into a buffer
    protrain.reduce_grads(manager, chunk, [param indices], [grads], [last readers])  # after the chunk's last
                                                               # gradient and (offloaded) its last read
    h = protrain.swap_out(space, slot, t, order)               # swapped activations (runtime/swap.py): forward,
    protrain.swap_settle(space, [slot, ...], [h, ...], [t, ...], after)  # forward, swap_interval blocks later
    protrain.swap_prefetch(space, [slot, ...], after)          # backward, a block's tensors ahead of their use,
    t = protrain.swap_in(space, slot, h, [after])              # backward, before the first use
    protrain.step_mark(monitor, x, [sizes])                    # forward start: a step (runtime/monitor.py)
    protrain.phase_mark(monitor, phase, [out, ...])            # forward or backward end, after its last values
    x2 = protrain.after(x, [values])                           # backward: x, copied once `values` exist

Ordering comes from data dependencies: every read of a parameter goes through its chunk's `gather`
output, `release` takes the outputs of the chunk's last readers as arguments and returns a token each later
`gather` waits for (each gather takes every release before it: they keep the graph's order), and
`reduce_grads` takes the gradients and those same last readers' outputs (an offloaded chunk's CPU update
starts at its reduce, so no read of its parameters may come after it, whatever order the compiler picks among
independent nodes). `release` and `reduce_grads` are registered as side-effecting, so no compiler removes them
(a token nothing waits for, or no output at all).

Custom ops are process-wide and take only tensors and numbers, so a graph names its ChunkManager by an
integer handle. `_MANAGERS` is that handle table: a weak mapping (a manager lives as long as its model's
parameters), written only when a manager registers. It is the one piece of module-level state in the
package, because torch.library gives an op no other way to reach an object.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.fx.node import has_side_effect

from protrain_fx.runtime.chunks.param_class import as_plain
from protrain_fx.shapes import strides_in

_MANAGERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def register(manager) -> int:
    """Give a ChunkManager (or a SwapSpace) the integer handle its graphs pass to the ops."""
    handle = next(_HANDLES)
    _MANAGERS[handle] = manager
    return handle


def _manager(handle: int):
    manager = _MANAGERS.get(handle)
    assert manager is not None, f"protrain runtime object {handle} is gone (its model or graph was deleted)"
    return manager


@torch.library.custom_op("protrain::gather", mutates_args=())
def gather(manager: int, chunk: int, after: list[torch.Tensor]) -> torch.Tensor:
    return _manager(manager).gather(chunk)


@gather.register_fake
def _(manager: int, chunk: int, after: list[torch.Tensor]) -> torch.Tensor:
    m = _manager(manager)
    return torch.empty(m.layout.chunk_elems, dtype=m.dtype, device=m.device)


@torch.library.custom_op("protrain::prefetch", mutates_args=())
def prefetch(manager: int, chunk: int, after: torch.Tensor) -> None:
    _manager(manager).prefetch(chunk)


@prefetch.register_fake
def _(manager: int, chunk: int, after: torch.Tensor) -> None:
    return None


@torch.library.custom_op("protrain::release", mutates_args=())
def release(manager: int, chunk: int, after: list[torch.Tensor]) -> torch.Tensor:
    m = _manager(manager)
    m.release(chunk)
    return torch.empty(0, device=m.device)  # the token later gathers wait for


@release.register_fake
def _(manager: int, chunk: int, after: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty(0, device=_manager(manager).device)


@torch.library.custom_op("protrain::materialize", mutates_args=())
def materialize(values: list[torch.Tensor]) -> None:
    """Nothing at run time: inductor computes an op's inputs into buffers, which keeps it from recomputing
    `values` inside later kernels (passes/chunks.py)."""


@materialize.register_fake
def _(values: list[torch.Tensor]) -> None:
    return None


@torch.library.custom_op("protrain::reduce_grads", mutates_args=())
def reduce_grads(
    manager: int, chunk: int, source: int, params: list[int], grads: list[torch.Tensor], after: list[torch.Tensor]
) -> None:
    m = _manager(manager)
    with as_plain():
        m.reduce_grads(chunk, source, [m.params[i] for i in params], grads)


@reduce_grads.register_fake
def _(
    manager: int, chunk: int, source: int, params: list[int], grads: list[torch.Tensor], after: list[torch.Tensor]
) -> None:
    return None


# A compiler may hand `t` over in another layout than the graph's (inductor does, for ops a pass inserted), so
# the slot's layout is an argument (its dimensions innermost first, shapes.dense_order: strides at any sizes) and
# the host copy's layout never depends on t's: a copy between layouts is still right, only slower. (A layout constraint would make inductor copy `t` into a buffer of its own, which
# it may hand to a later kernel while the host copy still reads it.)
@torch.library.custom_op("protrain::swap_out", mutates_args=())
def swap_out(space: int, slot: int, t: torch.Tensor, order: list[int]) -> torch.Tensor:
    return _manager(space).swap_out(slot, t, order)


@swap_out.register_fake
def _(space: int, slot: int, t: torch.Tensor, order: list[int]) -> torch.Tensor:
    return torch.empty_strided(t.shape, strides_in(t.shape, order), dtype=t.dtype, device="cpu")


@torch.library.custom_op("protrain::step_mark", mutates_args=())
def step_mark(monitor: int, first: torch.Tensor, sizes: list[int]) -> None:
    """`sizes`: the graph's `SymInt` inputs (none where its sizes are fixed), this step's sizes."""
    _manager(monitor).mark(tuple(sizes))


@step_mark.register_fake
def _(monitor: int, first: torch.Tensor, sizes: list[int]) -> None:
    return None


@torch.library.custom_op("protrain::phase_mark", mutates_args=())
def phase_mark(monitor: int, phase: int, after: list[torch.Tensor]) -> None:
    """`after`: the graph's outputs and the last tensor it computes (passes/monitor.py), which order the mark after
    the graph's work."""
    _manager(monitor).phase_mark(phase)


@phase_mark.register_fake
def _(monitor: int, phase: int, after: list[torch.Tensor]) -> None:
    return None


@torch.library.custom_op("protrain::swap_settle", mutates_args=())
def swap_settle(
    space: int, slots: list[int], copies: list[torch.Tensor], sources: list[torch.Tensor], after: torch.Tensor
) -> None:
    """`copies` (the slots' swap_out results) order it after their copies start; `sources` (the device tensors
    copied) keep them alive until here: no compiler may reuse their memory while a copy may still read it."""
    _manager(space).settle(slots)


@swap_settle.register_fake
def _(space: int, slots: list[int], copies: list[torch.Tensor], sources: list[torch.Tensor], after: torch.Tensor):
    return None


@torch.library.custom_op("protrain::swap_prefetch", mutates_args=())
def swap_prefetch(space: int, slots: list[int], after: torch.Tensor) -> None:
    _manager(space).prefetch(slots)


@swap_prefetch.register_fake
def _(space: int, slots: list[int], after: torch.Tensor) -> None:
    return None


@torch.library.custom_op("protrain::swap_in", mutates_args=())
def swap_in(space: int, slot: int, host: torch.Tensor, after: list[torch.Tensor]) -> torch.Tensor:
    """`after` (a value the output gradient flows into, or none) keeps any compiler from moving it, and the copy
    it may start, ahead of the point the backward has reached."""
    return _manager(space).swap_in(slot)


@swap_in.register_fake
def _(space: int, slot: int, host: torch.Tensor, after: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=_manager(space).device)


@torch.library.custom_op("protrain::after", mutates_args=())
def after(x: torch.Tensor, deps: list[torch.Tensor]) -> torch.Tensor:
    """A copy of `x` that exists only once `deps` do: what reads it is ordered after their producers, and no
    compiler fuses it with work before them (passes/activations.py: recompute_order_pass)."""
    return x.clone()


@after.register_fake
def _(x: torch.Tensor, deps: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(x)


has_side_effect(torch.ops.protrain.swap_prefetch.default)
has_side_effect(torch.ops.protrain.swap_settle.default)
has_side_effect(torch.ops.protrain.step_mark.default)
has_side_effect(torch.ops.protrain.phase_mark.default)
has_side_effect(torch.ops.protrain.prefetch.default)
has_side_effect(torch.ops.protrain.release.default)
has_side_effect(torch.ops.protrain.materialize.default)
has_side_effect(torch.ops.protrain.reduce_grads.default)


def register_inductor_lowering() -> None:
    """Lower `gather` and `swap_out` as fallback kernels whose outputs inductor never reuses for another buffer:
    they are a chunk buffer and a host swap slot, whose contents must survive until read again; the other ops as
    plain fallbacks (`_explicit_fallbacks`). And keep the attention's stride rule where a checkpointed block
    recomputes it (`_dense_recomputed_attention`)."""
    from torch._inductor.lowering import fallback_handler, lowerings, register_lowering
    from torch._inductor.virtualized import V

    _dense_recomputed_attention(lowerings)
    _explicit_fallbacks(lowerings)

    for op in (torch.ops.protrain.gather.default, torch.ops.protrain.swap_out.default):
        if op in lowerings:
            continue
        fallback = fallback_handler(op, add_to_fallback_set=False)

        def lowering(*args, fallback=fallback, **kwargs):
            out = fallback(*args, **kwargs)
            V.graph.never_reuse_buffers.add(out.get_name())
            return out

        register_lowering(op, type_promotion_kind=None)(lowering)


_PLAIN_FALLBACKS = (
    "prefetch",
    "release",
    "materialize",
    "reduce_grads",
    "step_mark",
    "phase_mark",
    "swap_settle",
    "swap_prefetch",
    "swap_in",
    "after",
)


def _explicit_fallbacks(lowerings: dict) -> None:
    """Every protrain op but `gather` and `swap_out` lowered as a fallback kernel, with the layout rule inductor's
    implicit fallback would give it. The implicit path logs the op's arguments, and torch 2.11 formats that
    message even where the log is off: an argument's unrealized IR prints as a tree, which grows exponentially
    where subexpressions are shared (GPT-NeoX's parallel residual) and stalled a 5.5B compile for minutes."""
    from torch._inductor.lowering import make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    for name in _PLAIN_FALLBACKS:
        op = getattr(torch.ops.protrain, name).default
        if op in lowerings:
            continue
        constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        make_fallback(op, layout_constraint=constraint, warn=False)


_ATTENTION = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
)


def _dense_recomputed_attention(lowerings: dict) -> None:
    """A recomputed random op (the fused attentions are, for their dropout) reaches the backward wrapped by
    AOTAutograd in `run_with_rng_state` (`graphsafe_` on CUDA), which inductor lowers as a plain fallback: without
    the attention's own layout rule, so a query laid out with its head dimension strided fails in cuDNN ("The
    stride for the last dimension ... should be 1") in a checkpointed block. Wrapped attentions get their query,
    key and value row-major, as `sdpa_constraint` gives them unwrapped."""
    from torch._inductor import ir
    from torch._prims import rng_prims

    for wrapper, op_at in ((rng_prims.graphsafe_run_with_rng_state, 0), (rng_prims.run_with_rng_state, 1)):
        lowering = lowerings.get(wrapper)
        if lowering is None or getattr(lowering, "protrain_dense_attention", False):
            continue

        def dense(*args, lowering=lowering, op_at=op_at, **kwargs):
            op = args[op_at]
            if getattr(op, "_opname", None) in _ATTENTION:
                qkv = [
                    ir.ExternKernel.require_stride_order(a, list(reversed(range(4))))
                    for a in args[op_at + 1 : op_at + 4]
                ]
                args = (*args[: op_at + 1], *qkv, *args[op_at + 4 :])
            return lowering(*args, **kwargs)

        dense.protrain_dense_attention = True
        lowerings[wrapper] = dense
