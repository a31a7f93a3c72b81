"""Checkpoints of a model whose parameters live in chunks: sharded (torch.distributed.checkpoint) and full.

`state_dict(model, optimizer)` gives what `torch.distributed.checkpoint` (DCP) saves and loads in place,
without gathering anything: each entry is a view of what this rank holds and steps.

- Model entries are keyed like `model.state_dict()`, parameters as their fp32 master (the values the
  optimizer steps; a bf16 model's own weights are those rounded), buffers as they are.
- Optimizer entries follow `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`: `state` keyed
  by parameter name (`step`, `exp_avg`, `exp_avg_sq`), `param_groups` with parameter names.
- A parameter of a chunk on the GPU (the same on every rank) is a plain tensor; DCP writes it once.
- A parameter of an offloaded chunk sharded across ranks is a `ShardedTensor` of the rank's piece: the flat
  element range the rank's shard cuts from it, as the few boxes (offsets, sizes) that cover that range, each
  a contiguous view of the host shard. DCP saves the pieces of every rank and, at load, reads whatever
  boxes the loading ranks hold: a checkpoint loads at any world size and into any plan.

Before the chunks are built (a fresh model, resumed before its first step) the entries are whole tensors,
and `load_state_dict` keeps the fp32 values for the chunks to take when they are built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from protrain_fx.runtime.adopt import model_manager, user_model
from protrain_fx.runtime.chunks import LOADED_MASTER_ATTR, ChunkManager
from protrain_fx.runtime.optim import OPTIMIZER_ATTR, AdamW

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, sizes
STATE_KEYS = ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The current full values on the CPU in the model's dtype, keyed exactly like `model.state_dict()`.

    A collective when parameters are sharded across ranks: every rank must call it. Chunks are fetched one
    at a time, so the host holds the result and one chunk. (`model.state_dict()` gives the same values.)
    Accepts the model or its `torch.compile` wrapper.
    """
    model = user_model(model, "full_state_dict()")
    manager = model_manager(model)
    values = {id(p): v for p, v in manager.outside.full_params()} if manager is not None else {}
    entries = model.state_dict(keep_vars=True)
    return {name: values[id(t)] if id(t) in values else t.detach().to("cpu", copy=True) for name, t in entries.items()}


@torch.no_grad()
def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """`{"model": ..., "optim": ...}` to save with `torch.distributed.checkpoint.save` or fill with `load`
    (see the module docstring); every rank calls it, no collective. To resume:

        state = protrain_fx.state_dict(model, optimizer)
        torch.distributed.checkpoint.load(state, checkpoint_id=path)
        protrain_fx.load_state_dict(model, optimizer, state)

    The optimizer is a `protrain_fx.optim.AdamW` over the model's parameters; omit it for the weights only.
    """
    model = user_model(model, "protrain_fx.state_dict()")
    manager = model_manager(model)
    out: dict[str, Any] = {"model": _model_entries(model, manager)}
    if optimizer is not None:
        out["optim"] = _optim_entries(model, _checked_optimizer(optimizer), manager)
    return out


@torch.no_grad()
def load_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Put `state` back: the dict `state_dict(model, optimizer)` gave and `torch.distributed.checkpoint.load`
    filled (already in place), or any dict of the same keys with whole tensors (a consolidated checkpoint),
    whose values are copied in. Chunks then compute with the loaded values. Every entry of the model and
    optimizer must be in `state`; with `strict` (as `nn.Module.load_state_dict`'s), `state` may hold no other."""
    model = user_model(model, "protrain_fx.load_state_dict()")
    if "model" not in state:
        raise ValueError(f"state has keys {sorted(state)}; expected the dict protrain_fx.state_dict() returns")
    if optimizer is not None and "optim" not in state:
        raise ValueError(
            "state holds no optimizer entries ('optim'): save it with protrain_fx.state_dict(model, optimizer), "
            "or pass optimizer=None to load the weights only"
        )
    manager = model_manager(model)
    mine = state_dict(model, optimizer)
    if strict:  # against every name of the model: a rank's own entries leave out the pieces only others hold
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        names |= {n for n, _ in model.named_buffers(remove_duplicate=False)} | set(mine["model"])
        _no_unexpected(names, state["model"], "model")
        if optimizer is not None:
            _no_unexpected(names | set(mine["optim"]["state"]), state["optim"]["state"], "optim.state")
    _copy_into(mine["model"], state["model"], "model")
    if manager is not None:
        for chunk in range(manager.layout.n_chunk):
            manager.publish(chunk)  # the compute copies take the loaded masters
    else:
        _keep_masters(model, mine["model"])
    if optimizer is None:
        return
    optimizer = _checked_optimizer(optimizer)
    _copy_into(mine["optim"]["state"], state["optim"]["state"], "optim.state")
    names = _param_names(model)
    saved = state["optim"]["param_groups"]
    for theirs, group in zip(saved, optimizer.param_groups):
        if list(theirs["params"]) != [names[p] for p in group["params"]]:
            raise ValueError("the checkpoint's optimizer param groups hold other parameters than this optimizer's")
    optimizer.load_hyperparameters(saved)
    if manager is None:  # whole states, placed where each parameter steps once its chunks are built
        by_name = {n: p for p, n in names.items()}
        optimizer.load_full_states({by_name[n]: st for n, st in mine["optim"]["state"].items()})


# ----- entries --------------------------------------------------------------------------------------------


def _checked_optimizer(optimizer: Any) -> AdamW:
    if not isinstance(optimizer, AdamW):
        raise TypeError(
            f"protrain_fx checkpoints hold protrain_fx.optim.AdamW states, got {type(optimizer).__name__}; "
            "for other optimizers use torch.distributed.checkpoint.state_dict.get_optimizer_state_dict"
        )
    return optimizer


def _param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: name for name, p in model.named_parameters()}


def _model_entries(model: nn.Module, manager: ChunkManager | None) -> dict[str, Any]:
    entries = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if manager is not None and id(t) in manager.index:
            entries[name] = _placed(manager, t, lambda chunk, a, b: manager.storage.master[chunk][a:b])
        elif isinstance(t, nn.Parameter) and t.dtype != torch.float32 and OPTIMIZER_ATTR in t.__dict__:
            entries[name] = t.detach().to(torch.float32)  # what becomes its master (kept by load_state_dict)
        else:
            entries[name] = t.detach()
    return {name: e for name, e in entries.items() if e is not None}


def _keep_masters(model: nn.Module, entries: dict[str, Any]) -> None:
    """Before the chunks are built: a loaded parameter takes its values, and keeps its fp32 master for the
    chunks (where its own dtype is lower)."""
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, nn.Parameter) and entries[name].dtype != t.dtype:
            t.data.copy_(entries[name])
            t.__dict__[LOADED_MASTER_ATTR] = entries[name]


def _optim_entries(model: nn.Module, optimizer: AdamW, manager: ChunkManager | None) -> dict[str, Any]:
    names = _param_names(model)
    missing = [p.shape for g in optimizer.param_groups for p in g["params"] if p not in names]
    if missing:
        raise ValueError(
            f"the optimizer steps {len(missing)} parameters that are not the model's (shapes {missing[:3]})"
        )
    states: dict[str, dict] = {}
    if manager is None:  # before the chunks: whole states (zeros until loaded), unless it stepped without them
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            states[names[p]] = {
                "step": torch.zeros((), dtype=torch.float32),
                **{k: torch.zeros(p.shape, dtype=torch.float32) for k in STATE_KEYS},
            }
    else:  # every rank holding a piece gives the same `step`; DCP writes it once
        for chunk in range(manager.layout.n_chunk):
            for p, st in optimizer.live_states(manager, chunk).items():
                pieces = {k: _placed(manager, p, lambda *_, piece=st[k]: piece) for k in STATE_KEYS}
                states[names[p]] = {"step": st["step"], **pieces}
    for p, st in optimizer.live_states(create=manager is not None).items():  # parameters no manager owns
        states[names[p]] = {"step": st["step"], **{k: st[k].view(p.shape) for k in STATE_KEYS}}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": states, "param_groups": groups}


def _placed(manager: ChunkManager, p: nn.Parameter, read) -> Any:
    """What this rank holds of `p`, for DCP: a plain view of the whole parameter where every rank holds it
    (persistent chunk, or one rank), a ShardedTensor of the rank's boxes where its chunk is sharded, None where
    this rank holds none of it. `read(chunk, a, b)` is the rank's tensor holding chunk elements [a, b) (for
    master: a view of the chunk's master; for states: the piece itself)."""
    slot = manager.slot_of(p)
    a, b = slot.offset, slot.offset + slot.numel
    if not manager.storage.is_sharded(slot.chunk):
        return read(slot.chunk, a, b).view(p.shape)
    shard = manager.layout.shard_elems
    pieces = [(r, max(a, r * shard), min(b, (r + 1) * shard)) for r in range(manager.world_size)]
    pieces = [(r, s - a, e - a) for r, s, e in pieces if s < e]  # in the parameter's elements
    mine = next(((s, e) for r, s, e in pieces if r == manager.rank), None)
    if mine is None:
        return None
    lo = manager.rank * shard
    values = read(slot.chunk, a + mine[0] - lo, a + mine[1] - lo)  # chunk elements, in shard coordinates
    metadata = [
        ShardMetadata(list(offsets), list(sizes), f"rank:{r}/cpu")
        for r, s, e in pieces
        for offsets, sizes in boxes(s, e, tuple(p.shape))
    ]
    local, at = [], 0
    for md in metadata:
        if md.placement.rank() == manager.rank:
            n = math.prod(md.shard_sizes)
            local.append(Shard(values[at : at + n].view(md.shard_sizes), md))
            at += n
    assert at == values.numel(), f"boxes of {slot.name} do not cover its piece"
    properties = TensorProperties(dtype=values.dtype)
    global_md = ShardedTensorMetadata(metadata, torch.Size(p.shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_md)


def boxes(start: int, end: int, shape: tuple[int, ...]) -> list[Box]:
    """The boxes (offsets, sizes) covering elements [start, end) of a row-major tensor of `shape`, in order,
    each contiguous in memory: a partial first row, whole rows, a partial last row (recursively per
    dimension). At most 2 * ndim - 1 boxes."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])
    r0, c0 = divmod(start, row)
    r1, c1 = divmod(end, row)
    rest = len(shape) - 1
    if r0 == r1:  # within one row
        return [((r0, *o), (1, *s)) for o, s in boxes(c0, c1, shape[1:])]
    out = []
    if c0:
        out += [((r0, *o), (1, *s)) for o, s in boxes(c0, row, shape[1:])]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *[0] * rest), (r1 - r0, *shape[1:])))
    if c1:
        out += [((r1, *o), (1, *s)) for o, s in boxes(0, c1, shape[1:])]
    return out


# ----- loading ----------------------------------------------------------------------------------------------


def _no_unexpected(mine: Mapping, theirs: Mapping, where: str) -> None:
    unexpected = [k for k in theirs if k not in mine]
    if unexpected:
        raise RuntimeError(
            f"Error(s) in loading the state: unexpected key(s) in {where}: {unexpected[:5]} ({len(unexpected)} in "
            "all), which this model (and optimizer) does not have; pass strict=False to ignore them"
        )


def _copy_into(mine: dict, theirs: Mapping, where: str) -> None:
    """Copy `theirs` into `mine` (nested dicts of tensors, `mine` views of what the model and optimizer hold),
    skipping tensors that are views of the same memory already (DCP filled them in place); a whole tensor
    fills a ShardedTensor's local boxes."""
    missing = [k for k in mine if k not in theirs]
    if missing:
        raise ValueError(f"the state to load has no {where} entries {missing[:5]} ({len(missing)} missing)")
    for key, dst in mine.items():
        src = theirs[key]
        if isinstance(dst, dict):
            _copy_into(dst, src, f"{where}.{key}")
        elif isinstance(dst, ShardedTensor):
            if isinstance(src, ShardedTensor):
                pairs = list(zip(dst.local_shards(), src.local_shards()))
                if len(pairs) != len(dst.local_shards()) or any(
                    a.metadata.shard_offsets != b.metadata.shard_offsets for a, b in pairs
                ):
                    raise ValueError(f"{where}.{key}: a ShardedTensor of another layout; load it with DCP instead")
                for a, b in pairs:
                    _copy_tensor(a.tensor, b.tensor, f"{where}.{key}")
                continue
            for shard in dst.local_shards():
                box = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
                shard.tensor.copy_(src[box])
        else:
            _copy_tensor(dst, src, f"{where}.{key}")


def _copy_tensor(dst: torch.Tensor, src: Any, where: str) -> None:
    if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dst.shape):
        got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
        raise ValueError(f"{where} is {got}; the model's is a tensor of shape {tuple(dst.shape)}")
    if src.device != dst.device or src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
        dst.copy_(src)
