"""clip_grad_norm_: global gradient-norm clipping of a model whose gradients live in chunks (runtime/chunks/).

Called between `backward()` and `optimizer.step()`, like `torch.nn.utils.clip_grad_norm_`. The norm covers
every gradient of the step: persistent chunks' fp32 gradients on the device (whole and equal on every rank
after their all-reduce: counted once), offloaded chunks' fp32 shards on the host (each rank its own shard:
summed over ranks) and the `.grad` of parameters no chunk holds. Only the pieces of parameters that got a
gradient this step count (a chunk's other slots hold stale values the optimizer never reads).

Clipping scales gradients the optimizer has not read yet, while offloaded chunks start their host update as
their gradient completes during the backward. A model's first step defers those updates to `AdamW.step()`
(`ChunkManager.defer_updates`), as a clip call may follow. Once the model is clipped, its later steps go by
the last clip: where it did not apply (the norm was under `max_norm`), the last `n_clip_overlap` offloaded
chunks (the plan's, searched with the cost model: planner/search.py) start their updates during the backward as
usual, each keeping the master and AdamW states it changes (`ChunkManager.speculates`); if this clip then
applies, those chunks take their kept values back and `AdamW.step()` updates them from the clipped gradients.
The other chunks, and all of them where the last clip applied, wait for `AdamW.step()`. The norms of offloaded
gradients are taken on the device as they arrive, so a clip that does not apply waits for no host work.
Persistent chunks of a clipped model update in `AdamW.step()`. A model first clipped at a later step, whose updates
ran during that step's backward, has that clip refused with an error (`ChunkManager.refuse_edit`: the step applies
unclipped) and clips exactly from the next step on.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

from protrain_fx.distributed import across_ranks
from protrain_fx.runtime.adopt import model_manager, user_model


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale the model's gradients so that their total `norm_type` norm is at most `max_norm`; returns the total
    norm before clipping (a float32 tensor on the CPU), as `torch.nn.utils.clip_grad_norm_` does."""
    model = user_model(model, "clip_grad_norm_()")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if max_norm < 0 or not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"clip_grad_norm_ needs max_norm >= 0 and norm_type > 0 or inf, got {max_norm}, {norm_type}")
    manager = model_manager(model)
    scale = 1.0  # the loss scale the gradients carry (float16, announced by GradScaler.unscale_)
    if manager is not None:
        if manager.edits.loss_scaled:
            scale = manager.carried_scale()
            if scale is None:
                raise ValueError(
                    "float16 gradients carry the loss scale: call scaler.unscale_(optimizer) before "
                    "clip_grad_norm_, as with torch.amp.GradScaler"
                )
        manager.clip_norm_type = norm_type
        manager.edits.expect_edits("clip_grad_norm_")
    known = manager.step_grads.arrival_norms(norm_type) if manager is not None else {}
    pieces = _gradient_pieces(model, manager, without=set(known))
    pieces.local_norms = list(known.values())
    total = _total_norm(pieces, norm_type, manager) / scale  # a norm scales with its vector
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total}, so they cannot be clipped; pass "
            "error_if_nonfinite=False to clip anyway"
        )
    coef = max_norm / (total + 1e-6)
    clips = coef < 1
    if manager is not None and clips:
        manager.refuse_edit("clip_grad_norm_ scaling the gradients", sorted(manager.step_grads.chunks))
        manager.edits.edit_grads("clip_grad_norm_ scaling the gradients")
    if clips:
        pieces = _gradient_pieces(model, manager) if known else pieces
        for tensors in _by_device(pieces.local + pieces.once):
            torch._foreach_mul_(tensors, coef)
    return torch.tensor(total, dtype=torch.float32)


def _by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The foreach kernels take tensors of one device (host shards and device gradients mix here)."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


@dataclasses.dataclass
class _Pieces:
    local: list[torch.Tensor] = dataclasses.field(default_factory=list)  # this rank's part (summed over ranks)
    once: list[torch.Tensor] = dataclasses.field(default_factory=list)  # the same on every rank (counted once)
    local_norms: list[torch.Tensor] = dataclasses.field(default_factory=list)  # norms of more `local` ones


def _gradient_pieces(model: nn.Module, manager, without: set[int] = frozenset()) -> _Pieces:
    """Every gradient of the step, but those of the chunks in `without`."""
    pieces = _Pieces()
    managed = set()
    if manager is not None:
        manager.finish_reduction()  # every gradient reduced across ranks
        for chunk in sorted(manager.step_grads.chunks - without):
            if chunk >= manager.n_persist:
                manager.wait_for_update(chunk)  # its gradient copy to the host has landed
            target = pieces.once if chunk < manager.n_persist else pieces.local
            for i, start, end, _ in manager.storage.param_pieces(chunk):
                if i in manager.step_grads.params:
                    target.append(manager.storage.grad[chunk][start:end])
        managed = {id(p) for p in manager.params}
    for p in model.parameters():
        if id(p) not in managed and p.grad is not None:
            pieces.once.append(p.grad)
    if manager is None or manager.world_size == 1:
        pieces.local, pieces.once = pieces.local + pieces.once, []
    return pieces


def _total_norm(pieces: _Pieces, norm_type: float, manager) -> float:
    """The norm over both lists: each rank's `local` pieces combined over ranks, the `once` ones as they are."""

    def partial(tensors: list[torch.Tensor], more: list[torch.Tensor] = ()) -> float:
        norms = [n for group in _by_device(tensors) for n in torch._foreach_norm(group, norm_type)]
        norms = [n.to("cpu", torch.float64) for n in [*norms, *more]]
        if not norms:
            return 0.0
        stacked = torch.stack(norms)
        return stacked.max().item() if norm_type == math.inf else stacked.pow(norm_type).sum().item()

    local, once = partial(pieces.local, pieces.local_norms), partial(pieces.once)
    if manager is not None and manager.world_size > 1:
        t = torch.tensor([local], dtype=torch.float64, device=manager.device)
        with across_ranks("the all-reduce of the gradient norm"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM)
        local = t.item()
    if norm_type == math.inf:
        return max(local, once)
    return (local + once) ** (1.0 / norm_type)
