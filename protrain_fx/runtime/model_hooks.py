"""What a chunked model's own methods do to its chunks: the hooks a `ChunkManager` puts on the model.

Chunked parameters are views of a device chunk (persistent) or hold no storage at all (offloaded: their values
live in the host arena, and the compiled graphs read them through `protrain.gather`). Everything else the
model is used for outside the compiled graphs goes through these hooks, on each module whose own parameters
are chunked:

- **forward outside the compiled graphs** (the uncompiled model, `generate()`, an eager region such as a
  function under `torch.compiler.disable`): a forward pre-hook gives the module's offloaded parameters their
  current values for the call (`Outside.lend`), and the forward hook takes them back after it, or, where
  autograd may read them in the backward, once the step is over. A compiled model's own hooks run in Python
  before Dynamo compiles its forward: they lend nothing where that frame will be compiled, but the parameters
  no graph read in the first step (`read_by_no_graph`: Dynamo gave up compiling the frame that reads them).
  Their gradients reach `.grad` through autograd, and the chunks take them in at the step
  (`ChunkManager.fold_plain_grads`). Compiled code never runs these hooks: traced into a graph, they return at
  once; and Dynamo never compiles their own frames (`skip_code`), which would make them return at once when a
  module is called from Python.
- **`load_state_dict`**: a pre-hook writes each chunked parameter's entry into its chunk (master and compute
  copy) and takes it out of what torch copies in; a post-hook takes those keys out of the missing ones, so
  `strict` works as for any model. `assign=True` cannot give a chunked parameter another tensor: an error.
- **`_apply`** (`.to()`, `.half()`, `.cuda()`, `.float()`, ...): where it would change a chunked parameter's
  dtype or device, an error saying what to do; where it changes nothing for them (`model.to(its device)`), it
  runs as usual.
- **`copy.deepcopy`** (runtime/deep_copy.py): a module of plain parameters holding the current values, without
  protrain's hooks and state, as the eager model's copy is.
- **`DistributedDataParallel`**: the chunked parameters are on the model's list of those DDP ignores, so DDP
  built over it later does not broadcast them (an offloaded one holds no storage of its own); with nothing left to
  reduce, torch refuses it ("DistributedDataParallel is not needed"). DDP built before the chunks passes the model
  through from its first compiled graph on (runtime/adopt.py, `pass_through_ddp`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from protrain_fx.runtime import deep_copy

if TYPE_CHECKING:
    from protrain_fx.runtime.chunks import ChunkManager


def install(manager: ChunkManager, model: nn.Module) -> None:
    """Hook every module of `model` whose own parameters `manager` holds."""
    ref = weakref.ref(manager)
    for module in model.modules():
        own = {
            name: manager.index[id(p)] for name, p in module._parameters.items() if p is not None and manager.holds(p)
        }
        if not own:
            continue
        indices = sorted(set(own.values()))
        handles = (
            module.register_forward_pre_hook(functools.partial(_before_forward, ref, indices)),
            module.register_forward_hook(functools.partial(_after_forward, ref, indices), always_call=True),
            module.register_load_state_dict_pre_hook(functools.partial(_load_into_chunks, ref, own)),
            module.register_load_state_dict_post_hook(functools.partial(_not_missing, own)),
        )
        deep_copy.note_hooks(module, *handles)
        module._apply = functools.partial(_guarded_apply, ref, indices, module._apply)
        deep_copy.install(ref, module)
    chunked = [name for name, p in model.named_parameters(remove_duplicate=False) if manager.holds(p)]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    model.__dict__[deep_copy.DDP_IGNORED_BEFORE] = ignored
    deep_copy.install(ref, model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [*ignored, *chunked])


def _run_in_python(fn: Callable) -> Callable:
    """Dynamo runs `fn`'s frame as Python wherever Python calls it, instead of compiling it on its own (where
    `is_dynamo_compiling()` would be True); traced from compiled code, it is inlined as usual."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)
    return fn


@_run_in_python
def _compiled_next(module: nn.Module) -> bool:
    """Dynamo will compile `module`'s forward frame: it is on (as for a compiled model's own hooks, which run in
    Python before it), and the forward is neither disabled nor a frame Dynamo leaves to Python (torch.nn's)."""
    from torch._dynamo import trace_rules

    if not torch._C._dynamo.eval_frame.get_eval_frame_callback():
        return False
    forward = module.forward
    return not getattr(forward, "_torchdynamo_disable", False) and not trace_rules.check(forward)


@_run_in_python
def _before_forward(ref: weakref.ref, indices: list[int], module: nn.Module, args: Any) -> None:
    if not torch.compiler.is_dynamo_compiling():
        _lend(ref, indices, unread_only=_compiled_next(module))


@torch.compiler.disable  # (Python calls it with Dynamo on, for a disabled forward: the manager stays Python)
def _lend(ref: weakref.ref, indices: list[int], *, unread_only: bool) -> None:
    """`unread_only`: Dynamo is to compile the forward, so only the parameters no graph read in the first step are
    lent: Dynamo gave up compiling a frame that reads them (a graph break it cannot resume from, inside a block
    called from a loop) and runs it as Python."""
    manager = ref()
    if manager is not None:
        lent = manager.outside.read_by_no_graph(indices) if unread_only else indices
        manager.outside.lend(lent, for_backward=torch.is_grad_enabled())


@_run_in_python
def _after_forward(ref: weakref.ref, indices: list[int], module: nn.Module, args: Any, output: Any) -> None:
    if not torch.compiler.is_dynamo_compiling():
        _take_back(ref, indices)


@torch.compiler.disable
def _take_back(ref: weakref.ref, indices: list[int]) -> None:
    manager = ref()
    if manager is not None:
        manager.outside.take_back(indices)


_LOADED = "_protrain_loaded_keys"  # in load_state_dict's local metadata: the keys written into chunks


def _load_into_chunks(
    ref: weakref.ref,
    own: dict[str, int],
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    manager = ref()
    if manager is None:
        return
    for name, index in own.items():
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(manager.params[index].shape):
            continue  # (torch reports what is missing or of the wrong size)
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError(
                f"load_state_dict(assign=True) would replace {key!r}, which lives in protrain chunks; load without "
                "assign (the values are copied into the chunks)"
            )
        manager.outside.load_param(index, value)
        del state_dict[key]
        module.__dict__.setdefault(_LOADED, set()).add(key)


def _not_missing(own: dict[str, int], module: nn.Module, incompatible_keys) -> None:
    loaded = module.__dict__.pop(_LOADED, set())
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]


def _guarded_apply(ref: weakref.ref, indices: list[int], original: Callable, fn: Callable, *args: Any, **kwargs: Any):
    """`module._apply`: an error where `fn` would change a chunked parameter's dtype or device."""
    manager = ref()
    for i in indices if manager is not None else ():
        p = manager.params[i]
        probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
        if isinstance(probe, torch.Tensor) and (probe.dtype != p.dtype or probe.device != p.device):
            raise ValueError(
                f"this would make {manager.slots[i].name!r} a {probe.dtype} tensor on {probe.device}, but it lives "
                f"in protrain chunks ({p.dtype} on {p.device}), built at the model's first compiled training step "
                "or by protrain_fx.prepare: cast or move the model before that. For the weights in another dtype "
                "or on the CPU, take protrain_fx.full_state_dict(model)"
            )
    return original(fn, *args, **kwargs)
