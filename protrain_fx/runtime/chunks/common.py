"""What the chunk modules and the rest of the runtime share: the attributes the chunks set on parameters and models,
and rules read outside the manager (which optimizers skip a non-finite step, the errors for a replaced, tied or
unfrozen parameter).

Kept apart from the manager's parts so that each of them, and runtime/adopt.py and runtime/optim.py, import these
without importing the manager.
"""

from __future__ import annotations

import torch

MANAGER_ATTR = "_protrain_chunk_manager"  # set on each managed nn.Parameter: the manager that owns it
OPTIMIZER_ATTR = "_protrain_optimizer"  # set on each parameter of a protrain_fx.optim.AdamW: a weak reference to it
NO_SYNC_ATTR = "_protrain_no_sync"  # on the model: how many `protrain_fx.no_sync` contexts are open
DDP_ATTR = "_protrain_ddp"  # on the model: weak reference to the DistributedDataParallel passing it through
# on a parameter loaded before its chunks were built: its fp32 values (the master; the parameter may be bf16)
LOADED_MASTER_ATTR = "_protrain_loaded_master"
# on a parameter of the model frozen when its chunks were built, which they left out
FROZEN_OUT_ATTR = "_protrain_frozen_out"

HOST_UPDATES_KEPT = 64  # host AdamW timings kept (runtime/chunks/host_updates.py)


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


def tied_param_error(name: str, now: str) -> ValueError:
    return ValueError(
        f"parameter {name!r} was tied to {now!r} (that parameter assigned in its place, as tie_weights() does) after "
        "the model's chunks were built (at its first compile, or by protrain_fx.prepare): a chunk holds each "
        "parameter where it was laid out, and cannot make two of them one. Tie weights before the chunks are built: "
        "before protrain_fx.prepare (without it, before the first compiled step), then build the optimizer and "
        "compile"
    )


def unfrozen_param_error(name: str) -> ValueError:
    return ValueError(
        f"parameter {name!r} was frozen (requires_grad=False) when the model's chunks were built (at its first "
        "compile, or by protrain_fx.prepare) and needs a gradient now: frozen parameters stay out of the chunks, "
        "which cannot take one in later. Unfreeze it before the first step (one to train only later can stay "
        "trainable with lr=0 in a parameter group of its own until then; its AdamW states then count from the "
        "first step), or load protrain_fx.full_state_dict(model) into the model built anew and compile that"
    )


def unfrozen_since_compile_error(name: str) -> ValueError:
    return ValueError(
        f"parameter {name!r} was frozen (requires_grad=False) when this graph was compiled and needs a gradient now, "
        f"but this torch ({torch.__version__}) runs the graph as compiled, which computes none for it: unfreeze it "
        "before the step that compiles the graph, or call torch._dynamo.reset() after unfreezing it so that the "
        "next step compiles anew"
    )
