"""Bringing a model under chunk management: when, in which order, and where the manager is kept.

A model is managed in chunks when its parameters belong to a `protrain_fx.optim.AdamW` (only that optimizer
can step parameters whose gradients live in chunks). The first compiled graph holding its parameters
builds the layout and the `ChunkManager`; the manager is kept on the model object, so every later graph
of the same model (graph breaks) shares it. `no_sync(model)` marks backward passes that only accumulate.

What goes in chunks: the trainable parameters a `protrain_fx.optim.AdamW` steps. Frozen parameters, and
parameters no such optimizer steps, stay plain tensors where they are (inference weights, as a LoRA
fine-tune's base model). Order of the layout: the parameters of the first graph by first use, then any other
of the model in registration order (a later graph's, which the first graph cannot see); the parameters of
different optimizers never share a chunk (each chunk is stepped by one).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from protrain_fx.capture import FrameRoots, block_index, find_block_families
from protrain_fx.distributed import rank_and_world_size
from protrain_fx.planner.chunking import ChunkLayout, ParamInfo, search_layout
from protrain_fx.planner.plan import Plan, grad_slot_fields, make_plan, with_default_master
from protrain_fx.real_tensors import real_tensors
from protrain_fx.runtime.chunks import (
    DDP_ATTR,
    FROZEN_OUT_ATTR,
    MANAGER_ATTR,
    NO_SYNC_ATTR,
    ChunkManager,
    replaced_param_error,
    skips_nonfinite,
    unfrozen_param_error,
)
from protrain_fx.runtime.optim import OPTIMIZER_ATTR
from protrain_fx.runtime.weights import ModuleFiller

log = logging.getLogger(__name__)

MODEL_ATTR = "_protrain_model_chunks"  # on the model object: its ChunkManager (MANAGER_ATTR is on each parameter)
NOTICE_ATTR = "_protrain_unchunked_notice"  # on a parameter compiled outside chunks: watched for its optimizer
TOLD_ATTR = "_protrain_told_unchunked"  # on an optimizer: logged already as stepping parameters outside chunks


def model_manager(model: nn.Module | None) -> ChunkManager | None:
    return None if model is None else model.__dict__.get(MODEL_ATTR)


def user_model(model: Any, caller: str) -> nn.Module:
    """The module a user passed, or the one under its `torch.compile` wrapper; a TypeError naming `caller`
    for anything else."""
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller} takes the model (an nn.Module), got {type(model).__name__}")
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation: backward passes inside add their gradients to those of the step so far, without
    starting any optimizer work (no CPU AdamW step, no reduction of persistent chunks across ranks); the step's
    last backward, outside, completes it as usual, so its CPU steps still overlap it. Like DDP's `no_sync`:

        for micro in batches[:-1]:
            with protrain_fx.no_sync(model):
                (compiled(**micro).loss / len(batches)).backward()
        (compiled(**batches[-1]).loss / len(batches)).backward()
        optimizer.step(); optimizer.zero_grad()

    `model` is the model or its `torch.compile` wrapper."""
    model = user_model(model, "no_sync()")
    model.__dict__[NO_SYNC_ATTR] = model.__dict__.get(NO_SYNC_ATTR, 0) + 1
    try:
        yield
    finally:
        model.__dict__[NO_SYNC_ATTR] -= 1


def wants_chunks(params: Sequence[nn.Parameter]) -> bool:
    """Whether a graph's parameters go in chunks: a protrain_fx.optim.AdamW steps some of them (asked at a model's
    compiles until its chunks are built; where none does, `_tell_stepped_elsewhere`)."""
    if any(OPTIMIZER_ATTR in p.__dict__ for p in params):
        return True
    _tell_stepped_elsewhere(params)
    return False


def _tell_stepped_elsewhere(params: Sequence[nn.Parameter]) -> None:
    """Trainable parameters a compiled graph reads, which another optimizer steps (the Hugging Face Trainer's own
    torch.optim.AdamW, where no `optimizers=` is passed), train with no chunks and nothing offloaded, and nothing
    else would say so: the first step of such an optimizer (in the first training step) says it, with what to
    pass. The optimizer is met where it steps (`_StepWatch`, a hook torch.optim runs before every optimizer's
    step), not looked for at the compile, which would read every object the garbage collector tracks; a backward
    alone or `explain` steps nothing and hears nothing. Said once: each optimizer named is marked (TOLD_ATTR: the
    watches of the model's other graphs keep quiet about it), and so are the parameters watched (NOTICE_ATTR: a
    later compile of the model does not watch them again)."""
    trainable = [p for p in params if p.requires_grad and NOTICE_ATTR not in p.__dict__]
    for p in trainable:
        p.__dict__[NOTICE_ATTR] = True
    if trainable:
        _StepWatch(trainable)


class _StepWatch:
    """A hook before every optimizer's step (torch.optim's `register_optimizer_step_pre_hook`), watching
    parameters compiled outside chunks: the first optimizer that steps one of them, and no protrain_fx.optim.AdamW
    steps it, is told of once (`_tell_stepped_elsewhere`). It holds the parameters weakly and is removed when the
    first of them is collected; once told, it does nothing (torch runs the hooks from the dict it would be removed
    from)."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = weakref.WeakValueDictionary({id(p): p for p in params})
        self.told = False
        handle = register_optimizer_step_pre_hook(self)
        weakref.finalize(params[0], handle.remove)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.told or not any(self._watched(p) for p in _stepped_by(optimizer)):
            return
        self.told = True
        if TOLD_ATTR in optimizer.__dict__:
            return
        optimizer.__dict__[TOLD_ATTR] = True
        log.warning(
            "the parameters of a model compiled with backend='protrain' are stepped by %s.%s, not "
            "protrain_fx.optim.AdamW: none of them is in chunks or offloaded to the host (the backend plans "
            "activations only). To train in chunks, step them with protrain_fx.optim.AdamW(model.parameters(), "
            "lr=...) built before the first step; with the Hugging Face Trainer, pass "
            "optimizers=(protrain_fx.optim.AdamW(model.parameters(), lr=...), scheduler)",
            type(optimizer).__module__,
            type(optimizer).__qualname__,
        )

    def _watched(self, p: nn.Parameter) -> bool:
        """A parameter of this watch, which no protrain_fx.optim.AdamW steps."""
        return self.params.get(id(p)) is p and OPTIMIZER_ATTR not in p.__dict__


def _stepped_by(optimizer: torch.optim.Optimizer) -> Iterator[nn.Parameter]:
    """The parameters `optimizer` steps (one whose construction failed has no groups: none)."""
    for group in getattr(optimizer, "param_groups", None) or ():
        yield from group.get("params", ())


def _trained_in_chunks(p: nn.Parameter) -> bool:
    return OPTIMIZER_ATTR in p.__dict__ or MANAGER_ATTR in p.__dict__


def pass_through_ddp(params: Sequence[nn.Parameter]) -> None:
    """A graph compiled inside `DistributedDataParallel`'s forward (accelerate's `prepare` and the Hugging Face
    Trainer wrap the model with several processes) that reads parameters trained in chunks: the chunks reduce
    their gradients across ranks themselves, so from here on DDP passes the model through. Its forward calls the
    model with nothing before or after (no reducer, which would wait for gradients that never reach `.grad`; no
    buffer broadcast), and its `no_sync` acts as `protrain_fx.no_sync` (`ChunkManager.sync_grads`).

    The model DDP wraps must be compiled itself (not the wrapper: the compiled frame is then the model's), and
    every trainable parameter of it trained in chunks; otherwise an error that says what to do."""
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None or not any(_trained_in_chunks(p) for p in params):
        return
    plain = [n for n, p in ddp.module.named_parameters() if p.requires_grad and not _trained_in_chunks(p)]
    if plain:
        raise ValueError(
            "this model is wrapped in torch.nn.parallel.DistributedDataParallel and trained in protrain chunks, "
            "which reduce their gradients across ranks themselves, but DDP would have to reduce those of trainable "
            f"parameters no protrain_fx.optim.AdamW steps ({', '.join(plain[:3])}{', ...' if len(plain) > 3 else ''})"
            ": give every trainable parameter to protrain_fx.optim.AdamW (or freeze it), or leave the model out of "
            "DDP (with accelerate, out of accelerator.prepare())"
        )
    # (read by DDP's forward only: the C++ reducer built in its constructor is never asked to reduce)
    ddp._use_python_reducer = True
    ddp.module.__dict__[DDP_ATTR] = weakref.ref(ddp)


def updates_wait(params: Sequence[nn.Parameter]) -> bool:
    """Whether chunks of `params` update only in `AdamW.step()`, where their optimizer skips a step with an inf
    or NaN gradient (`skips_nonfinite`; known before any chunk is built)."""
    owner = next((p.__dict__[OPTIMIZER_ATTR] for p in params if OPTIMIZER_ATTR in p.__dict__), None)
    return bool(params) and skips_nonfinite(owner() if owner is not None else None, params[0].dtype)


def _in_chunks(p: nn.Parameter) -> bool:
    """Whether a parameter goes in chunks: trainable and stepped by a protrain_fx.optim.AdamW."""
    return p.requires_grad and OPTIMIZER_ATTR in p.__dict__


def _ordered_params(
    roots: FrameRoots, record, example_inputs: Sequence[Any], every_trainable: bool
) -> list[tuple[str, nn.Parameter]]:
    entries = sorted(
        record.param_map.values(),
        key=lambda e: (e.first_use_index is None, e.first_use_index or 0),
    )
    chunked = (lambda p: p.requires_grad) if every_trainable else _in_chunks
    ordered = [(e.name, example_inputs[e.index]) for e in entries if chunked(example_inputs[e.index])]
    seen = {id(p) for _, p in ordered}
    if roots.model is None:
        raise ValueError(
            "protrain found no module holding the compiled graph's parameters among the compiled frame's locals, "
            "the globals it reads and the modules being called: compile the model (torch.compile(model) or "
            "model.compile()), or a function that calls it, rather than a function given its parameters"
        )
    for name, p in roots.model.named_parameters():
        if chunked(p) and id(p) not in seen:
            ordered.append((name, p))
            seen.add(id(p))
    return ordered


def model_layout(
    roots: FrameRoots,
    record,
    example_inputs: Sequence[Any],
    forced: Mapping[str, Any],
    *,
    every_trainable: bool = False,
) -> ChunkLayout:
    """The chunk layout of the whole model (see the module docstring); `every_trainable`: as if a
    protrain_fx.optim.AdamW stepped every trainable parameter (protrain_fx.explain)."""
    alone = {e.name for e in record.param_map.values() if e.read_again_at}  # read again after blocks ran: tied
    ordered = _ordered_params(roots, record, example_inputs, every_trainable)
    whole = roots.model is not None and DDP_ATTR in roots.model.__dict__  # (DDP passes it through: not sharded)
    return _layout(ordered, record.block_map.block_of, forced, alone, world_size=1 if whole else None)


def _layout(
    ordered: list[tuple[str, nn.Parameter]],
    block_of: Callable[[str], int | None],
    forced: Mapping[str, Any],
    alone: set[str],
    world_size: int | None = None,
) -> ChunkLayout:
    """Lay out `ordered` (name, parameter) pairs, in that order, in chunks; the parameters named in `alone` each
    in a chunk of its own (planner/chunking.py); sharded across `world_size` ranks (default: all)."""
    dtypes = {p.dtype for _, p in ordered}
    if len(dtypes) > 1:
        raise ValueError(
            f"trainable parameters have several dtypes {sorted(map(str, dtypes))}; chunks hold one dtype: "
            "cast the model to one (e.g. model.to(torch.bfloat16))"
        )
    owners: dict[int, int] = {}  # id of the optimizer stepping a parameter -> its group in the layout
    infos = [
        ParamInfo(
            name=n,
            numel=p.numel(),
            block=block_of(n),
            alone=n in alone,
            group=owners.setdefault(_owner_id(p), len(owners)),
        )
        for n, p in ordered
    ]
    world_size = rank_and_world_size()[1] if world_size is None else world_size
    layout = search_layout(infos, ordered[0][1].element_size(), world_size, chunk_bytes=forced.get("chunk_bytes"))
    log.info(
        "chunk layout: %d chunks of %.2f MiB, %.2f MiB padding",
        layout.n_chunk,
        layout.chunk_bytes / 2**20,
        layout.waste_bytes / 2**20,
    )
    return layout


def _owner_id(p: nn.Parameter) -> int:
    """Which protrain_fx.optim.AdamW steps the parameter (0: none yet)."""
    ref = p.__dict__.get(OPTIMIZER_ATTR)
    return id(ref()) if ref is not None and ref() is not None else 0


def build_manager(model: nn.Module, layout: ChunkLayout, plan: Plan) -> ChunkManager:
    by_name = dict(model.named_parameters(remove_duplicate=False))  # (a tied parameter under any of its names)
    params = [by_name[slot.name] for slot in layout.slots]
    with real_tensors():  # called from the partitioner, under AOTAutograd's fake mode
        manager = ChunkManager(
            params,
            layout,
            n_persist=plan.n_persist,
            n_buffer=plan.n_buffer,
            model=model,
            grad_slots=plan.host_grad_slots,
            device_grad_slots=plan.device_grad_slots,
            master_dtype=plan.master_dtype,
            n_device_shard=plan.n_device_shard,
        )
    model.__dict__[MODEL_ATTR] = manager
    return manager


def place_chunks(manager: ChunkManager, plan: Plan) -> None:
    """A prepared model's chunks where the first compile's plan puts them (`ChunkManager.place`)."""
    with real_tensors():  # called from the partitioner, under AOTAutograd's fake mode
        manager.placement.place(
            plan.n_persist, plan.n_buffer, plan.host_grad_slots, plan.device_grad_slots, plan.n_device_shard
        )


def check_params_managed(manager: ChunkManager, param_map: Mapping, example_inputs: Sequence[Any]) -> None:
    """A graph compiled after the chunks were built may read the parameters they hold, and plain ones (frozen, or
    stepped by another optimizer); not a parameter put where a chunked one was, given to a protrain_fx AdamW after
    the chunks were built, or unfrozen since they were; nor one tied to another since (`check_model_params`)."""
    manager.check_model_params()
    for entry in param_map.values():
        p = example_inputs[entry.index]
        if manager.holds(p) or not (entry.name in manager.names or _in_chunks(p)):
            continue
        if FROZEN_OUT_ATTR in p.__dict__ and entry.name not in manager.names:
            raise unfrozen_param_error(entry.name)
        raise replaced_param_error(entry.name)


def plan_fields_of(manager: ChunkManager, forced: Mapping[str, Any]) -> dict[str, Any]:
    """`forced` with the chunk fields of the model's existing chunks; forcing other values is an error. Chunks
    waiting for their plan (`prepare` without `n_persist`) fix only their layout and what `prepare` was given."""
    actual = {
        "n_chunk": manager.layout.n_chunk,
        "chunk_bytes": manager.layout.chunk_bytes,
        "master_dtype": manager.master_dtype_name,
    }
    if manager.pending_plan is not None:
        actual.update({k: v for k, v in manager.pending_plan.items() if k not in actual})
    else:
        actual.update(
            n_persist=manager.n_persist,
            n_device_shard=manager.n_device_shard,
            host_grad_slots=manager.storage.grad_slots,
            device_grad_slots=manager.storage.device_grad_slots,
        )
        if manager.n_buffer:
            actual["n_buffer"] = manager.n_buffer
    # (a forced chunk_bytes of 0 is the size the layout chooses: the one it chose; gradient buffers or shards forced
    # above the chunks that share them are one each, as the plan made them)
    asked = dict(forced)
    if manager.pending_plan is None:
        made = grad_slot_fields(forced, manager.layout.n_chunk, manager.n_persist, manager.n_device_shard)
        asked.update((k, v) for k, v in made.items() if k in forced)
    clash = {
        k: (forced[k], v)
        for k, v in actual.items()
        if k in forced and asked[k] != v and (k, forced[k]) != ("chunk_bytes", 0)
    }
    if clash:
        raise ValueError(
            "options['plan'] asks for "
            + ", ".join(f"{k}={asked}" for k, (asked, _) in clash.items())
            + " but the model's chunks were already built (by protrain_fx.prepare or its first compiled graph) with "
            + ", ".join(f"{k}={have}" for k, (_, have) in clash.items())
            + "; pass the plan where the chunks are built, or drop those fields"
        )
    return {**forced, **actual}


def prepare(
    model: nn.Module,
    *,
    plan: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    init: Callable[[nn.Module], None] | None = None,
    weights: str | os.PathLike | None = None,
) -> nn.Module:
    """Put the trainable parameters of a model built on the CPU (or on the meta device) into chunks on
    `device` (default: CUDA when available), before `torch.compile(model, backend="protrain")`.

    Use it for a model that does not fit the GPU: every chunk's master goes to host memory, one parameter at a
    time, and each parameter then looks like a `device` tensor to Dynamo while its values live in the chunks.
    The first compile profiles the model on demand (offloaded parameters fetched per use), searches the plan as
    for a model on the GPU, and then moves the chunks the plan keeps persistent to the device. A model already
    on the GPU needs no `prepare`.

    - `plan`: chunk fields, as in `options={"plan": ...}` (`n_persist`, `n_buffer`, `chunk_bytes`,
      `master_dtype`); those given are held, the rest searched at the first compile (with `n_persist` given, and
      `n_buffer` too where chunks are offloaded, the chunks are placed here). The compile's options need not
      repeat them.
    - `init(module)`: for a model built under `torch.device("meta")`: called on each module after its own
      parameters and buffers are allocated on `device` (the parameter objects stay the same) to fill them,
      just before they are copied into the chunks; so neither the host nor the device holds the whole model
      besides the chunks, and random initialisation runs at the device's speed.
    - `weights`: a Hugging Face checkpoint in safetensors (a `save_pretrained` folder, sharded or not, or one
      `.safetensors` file) whose values fill each module the same way, after `init` (runtime/weights.py); one
      model tensor at a time, so a meta model's host memory peaks at the chunks plus one tensor and the checkpoint
      tensors it is made from. A transformers model loads what `from_pretrained(path)` loads, by its rules
      (runtime/pretrained.py: renamed and converted keys, base-model prefixes, ties, missing tensors initialised by
      its `_init_weights`, the dtype, the report of keys; a checkpoint of another architecture is an error); any
      other module by its tensors' names, a tied parameter under any of them.

    Layout order is registration order (`model.named_parameters()`), blocks kept whole where the size
    allows, a tied parameter outside the blocks (an embedding the head reads too) in a chunk of its own. Returns
    the model (changed in place). Build `protrain_fx.optim.AdamW(model.parameters())` before or after, then
    compile.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare() takes an nn.Module, got {type(model).__name__}")
    if model_manager(model) is not None:
        raise ValueError("this model's parameters are in chunks already; prepare() it once, before compiling")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters; nothing to put in chunks")
    # (checks that every tensor gets a value before anything is built; a Hugging Face model is tied and cast here)
    fill = ModuleFiller(model, init, weights, device)
    ordered = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = dict(plan or {})
    layout, chosen, pending = _prepared_plan(model, ordered, plan)
    owner = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}

    def source(p: nn.Parameter) -> torch.Tensor:
        fill(owner[id(p)])
        return p.detach()

    manager = ChunkManager(
        [p for _, p in ordered],
        layout,
        n_persist=chosen.n_persist,
        n_buffer=chosen.n_buffer,
        device=device,
        source=source,
        model=model,
        grad_slots=1 if pending else chosen.host_grad_slots,
        device_grad_slots=chosen.device_grad_slots,
        master_dtype=chosen.master_dtype,
        pending_plan=plan if pending else None,
    )
    model.__dict__[MODEL_ATTR] = manager
    _rest_to_device(model, manager, fill, device)
    fill.close()
    log.info("prepared %d parameters in %d chunks on %s", len(ordered), layout.n_chunk, device)
    return model


def _prepared_plan(
    model: nn.Module, ordered: list[tuple[str, nn.Parameter]], plan: dict[str, Any]
) -> tuple[ChunkLayout, Plan, bool]:
    """`prepare`'s layout (registration order, blocks whole where the size allows, a tied parameter outside the
    blocks in a chunk of its own), the plan its chunks are built for, and whether they wait for the first compile's
    search (`pending`): every chunk waits offloaded unless the plan leaves it nothing to place, since how many
    buffers offloaded chunks need is known only from the graphs (passes/chunks.py `buffers_needed`)."""
    families = find_block_families(model)

    def block_of(name: str) -> int | None:
        return block_index(name.split("."), families)

    # no graph says which parameters the forward reads again after the blocks: those tied, outside the blocks
    names = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    alone = {n for n, p in ordered if names[id(p)] > 1 and block_of(n) is None}
    layout = _layout(ordered, block_of, plan, alone)
    n_blocks = sum(f.n_blocks for f in families)
    given = make_plan(n_blocks, with_default_master(plan, layout), layout)  # (the user's fields, checked)
    pending = "n_persist" not in plan or ("n_buffer" not in plan and given.n_persist < layout.n_chunk)
    fields = {**plan, "n_persist": 0, "n_buffer": plan.get("n_buffer", 1)}
    chosen = make_plan(n_blocks, with_default_master(fields, layout), layout) if pending else given
    return layout, chosen, pending


def _rest_to_device(model: nn.Module, manager: ChunkManager, fill: ModuleFiller, device: torch.device) -> None:
    """What is not in chunks (buffers, frozen parameters) filled and moved to the device, module by module."""
    for module in model.modules():
        fill(module)
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if id(t) not in manager.index and t.device != device:
                if isinstance(t, nn.Parameter):
                    t.data = t.data.to(device)
                else:
                    module._buffers[name] = t.to(device)
