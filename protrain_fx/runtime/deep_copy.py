"""`copy.deepcopy` of a chunked model, or of one of its modules (a reference model, a frozen copy to compare
against): what the eager model's deep copy is, a module of plain parameters holding their current values on their
device, with none of protrain's hooks or state. Copied the default way, an offloaded parameter's clone reads the
storage it does not have (a crash), and the model's ChunkManager cannot be copied.

`model_hooks.install` puts `__deepcopy__` on the model and on each module with chunked parameters of its own, where
`copy.deepcopy` finds it before its default way. It puts the parameters' copies in the memo first (a collective
where a chunk is sharded: every rank copies, as every rank trains), sets protrain's attributes of the modules aside
and hooks aside while the default way copies the rest.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

PREFIX = "_protrain"  # every attribute protrain keeps on a module starts with it
HOOK_IDS = "_protrain_hook_ids"  # on a module: the ids of the hooks protrain registered on it (`note_hooks`)
DDP_IGNORED_BEFORE = "_protrain_ddp_ignored_before"  # on the model: DDP's ignore list before the chunked parameters
# the hook dictionaries of a module, keyed by hook id
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def install(manager_ref: weakref.ref, module: nn.Module) -> None:
    """`copy.deepcopy(module)` copies as `deep_copy` does."""
    module.__dict__["__deepcopy__"] = functools.partial(deep_copy, manager_ref, weakref.ref(module))


def note_hooks(module: nn.Module, *handles: RemovableHandle) -> None:
    """Hooks protrain registered on `module`, which its deep copy leaves out."""
    module.__dict__[HOOK_IDS] = (*module.__dict__.get(HOOK_IDS, ()), *(handle.id for handle in handles))


def deep_copy(manager_ref: weakref.ref, module_ref: weakref.ref, memo: dict[int, Any]) -> nn.Module:
    """The module's deep copy (see the module docstring); `memo` is copy.deepcopy's."""
    module, manager = module_ref(), manager_ref()
    assert module is not None, "copy.deepcopy called a module's __deepcopy__ after the module was freed"
    if manager is not None:
        with torch.no_grad():
            for p in module.parameters():
                if id(p) not in memo and manager.holds(p):
                    values = manager.outside.param_values(manager.index[id(p)])
                    memo[id(p)] = nn.Parameter(values.clone(), requires_grad=p.requires_grad)
    set_aside = {m: (_protrain_state(m), _hooks(m)) for m in module.modules()}
    try:
        for m, (state, hooks) in set_aside.items():
            for key in state:
                del m.__dict__[key]
            ours = set(state.get(HOOK_IDS, ()))
            for name, entries in hooks.items():
                getattr(m, name).clear()
                getattr(m, name).update((k, v) for k, v in entries if k not in ours)
        copied = copy.deepcopy(module, memo)
    finally:
        for m, (state, hooks) in set_aside.items():
            m.__dict__.update(state)
            for name, entries in hooks.items():
                getattr(m, name).clear()
                getattr(m, name).update(entries)  # (in their order)
    for m, (state, _) in set_aside.items():
        if DDP_IGNORED_BEFORE in state:
            _ddp_ignored_as_before(memo[id(m)], state[DDP_IGNORED_BEFORE])
    return copied


def _protrain_state(module: nn.Module) -> dict[str, Any]:
    """What protrain keeps in the module's `__dict__`: its attributes, and the `_apply` and `__deepcopy__` it put
    there (on a module it hooked)."""
    state = {k: v for k, v in module.__dict__.items() if k.startswith(PREFIX)}
    for key in ("_apply", "__deepcopy__") if state else ():
        if key in module.__dict__:
            state[key] = module.__dict__[key]
    return state


def _hooks(module: nn.Module) -> dict[str, list[tuple[int, Any]]]:
    """The entries of each of the module's hook dictionaries holding a hook protrain registered, in their order."""
    ours = set(module.__dict__.get(HOOK_IDS, ()))
    dicts = {name: getattr(module, name) for name in HOOK_DICTS}
    return {name: list(hooks.items()) for name, hooks in dicts.items() if ours & hooks.keys()}


def _ddp_ignored_as_before(copied: nn.Module, before: list[str]) -> None:
    """The copy's list of what DDP ignores, as it was before protrain added the chunked parameters."""
    if before:
        copied._ddp_params_and_buffers_to_ignore = list(before)
    else:
        copied.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
