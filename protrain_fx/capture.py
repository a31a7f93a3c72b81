"""Capture: what each compiled graph holds, read once from the graphs and the model they come from.

Two maps are built per graph and kept on its `GraphRecord`:

- the parameter map: each parameter placeholder -> the `nn.Parameter`, its qualified name and its first use
  in execution order. Parameters are matched to Dynamo's example inputs by identity (a tied weight is one
  input, so one entry).
- the block map: each node of the joint (forward + backward) graph -> the transformer block it belongs to.

Both need to know where the compiled frame sits in the model. A graph break can start a graph inside a
decoder layer (OPT on torch 2.11 compiles each layer as its own graph, with the layer as `L['self']`), so
Dynamo's sources and module stacks are relative to the frame's locals. `find_frame_roots` finds one
parameter of each local among the parameters of the outermost modules alive (those no other module holds),
which gives the model and every source's full qualified name.
The blocks are then read off the model with no per-model code: the `ModuleList` (or `Sequential`) of
repeated children of one type with modules inside; Hugging Face models name that type in
`_no_split_modules`, which wins when present, otherwise the longest list does. A node belongs to block `i`
when its `nn_module_stack` passes through `<list>.<i>`; backward nodes carry the stack of the forward op
they differentiate; nodes with no stack take the block of their inputs (see `_inherited_block`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._dynamo.eval_frame import OptimizedModule

log = logging.getLogger(__name__)

PRE, POST, OUTSIDE, BLOCK = "pre", "post", "outside", "block"

_SOURCE_PREFIX = re.compile(r"^L\[[^\]]+\](\[\d+\])?")
_SOURCE_TOKEN = re.compile(r"\['([^'\]]+)'\]|\.(\w+)|\[(\d+)\]")
_CONTAINER_TOKENS = {"_modules", "_parameters", "_buffers"}


def _split_source(source_text: str) -> tuple[str, str]:
    """`L['self']._modules['fc1']._parameters['weight']` -> (`L['self']`, `fc1.weight`).

    Also accepts Dynamo's short module paths such as `L['self'].model.layers[0].mlp`.
    """
    match = _SOURCE_PREFIX.match(source_text)
    prefix = match.group(0) if match else ""
    rest = source_text[len(prefix) :]
    tokens = [next(g for g in m.groups() if g is not None) for m in _SOURCE_TOKEN.finditer(rest)]
    return prefix, ".".join(t for t in tokens if t not in _CONTAINER_TOKENS)


def qualified_name(source_text: str, roots: dict[str, str] | None = None) -> str:
    """The qualified name in the model of a Dynamo source; `roots` maps a frame local to its path in the model."""
    prefix, rest = _split_source(source_text)
    root = (roots or {}).get(prefix, "")
    return ".".join(p for p in (root, rest) if p)


def _source_text(placeholder: fx.Node) -> str | None:
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else str(name)


def _parameter_names() -> dict[int, list[tuple[nn.Module, str]]]:
    """Every parameter alive in the process (by id) -> (outermost module holding it, its qualified name there),
    one entry per name (a tied weight has several).

    The outermost modules are those no other module holds in its `_modules`, found in one pass over the objects
    the garbage collector tracks. torch.compile's wrapper, which holds the model, is left out: names are the
    model's own, as in its state_dict.
    """
    # (type(), not isinstance: isinstance reads `__class__`, which a weak proxy to a dead object raises on; a
    # module whose __init__ has not run yet has no `_modules`)
    modules = [
        o
        for o in gc.get_objects()
        if issubclass(type(o), nn.Module) and not issubclass(type(o), OptimizedModule) and "_modules" in o.__dict__
    ]
    held = {id(child) for m in modules for child in m._modules.values() if child is not None}
    names: dict[int, list[tuple[nn.Module, str]]] = {}
    for root in (m for m in modules if id(m) not in held):
        for name, param in root.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append((root, name))
    return names


@dataclasses.dataclass
class FrameRoots:
    """Where the compiled frame's locals sit in the model (see the module docstring)."""

    model: nn.Module | None = None
    paths: dict[str, str] = dataclasses.field(default_factory=dict)  # source prefix -> path in the model


def find_frame_roots(dynamo_gm: fx.GraphModule, example_inputs: Sequence[Any]) -> FrameRoots:
    roots, names = FrameRoots(), None
    placeholders = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    for ph, value in zip(placeholders, example_inputs):
        text = _source_text(ph)
        if not isinstance(value, nn.Parameter) or text is None:
            continue
        prefix, relative = _split_source(text)
        if prefix in roots.paths:
            continue
        names = _parameter_names() if names is None else names
        located = next(((m, n) for m, n in names.get(id(value), ()) if n.endswith(relative)), None)
        if located is None:
            continue
        roots.model, full = located
        roots.paths[prefix] = full[: len(full) - len(relative)].rstrip(".")
    return roots


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    """One parameter input of a graph."""

    index: int  # position among the graph's inputs (= AOT primal index)
    placeholder: str  # the AOT placeholder name, primals_<index+1>
    name: str  # qualified name in the model, e.g. model.layers.0.mlp.up_proj.weight
    shape: tuple[int, ...]
    dtype: str
    first_use: str | None  # name of the first node reading it, in execution order (None if unused)
    first_use_index: int | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_param_map(
    dynamo_gm: fx.GraphModule, example_inputs: Sequence[Any], joint: fx.GraphModule, roots: FrameRoots
) -> dict[str, ParamEntry]:
    """Parameter map of one graph: AOT primal placeholder name -> ParamEntry."""
    dynamo_phs = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    assert len(dynamo_phs) == len(example_inputs), "Dynamo placeholders and example inputs differ in number"
    assert len(primals) == len(example_inputs), (
        f"joint graph has {len(primals)} primals for {len(example_inputs)} inputs; AOT added inputs we cannot map"
    )
    order = {n: i for i, n in enumerate(joint.graph.nodes)}
    entries: dict[str, ParamEntry] = {}
    for i, (ph, value, primal) in enumerate(zip(dynamo_phs, example_inputs, primals)):
        if not isinstance(value, nn.Parameter):
            continue
        source = _source_text(ph)
        users = sorted(primal.users, key=order.__getitem__)
        entries[primal.name] = ParamEntry(
            index=i,
            placeholder=primal.name,
            name=qualified_name(source, roots.paths) if source else ph.name,
            shape=tuple(value.shape),
            dtype=str(value.dtype).removeprefix("torch."),
            first_use=users[0].name if users else None,
            first_use_index=order[users[0]] if users else None,
        )
    return entries


@dataclasses.dataclass(frozen=True)
class BlockFamily:
    """The repeated blocks of a model: the children `<parent>.<i>` of one module list, all of one type."""

    parent: str  # e.g. model.layers
    type_name: str  # e.g. LlamaDecoderLayer
    n_blocks: int  # blocks in the model (a graph may hold only some of them)


@dataclasses.dataclass(frozen=True)
class BlockMap:
    """Node name -> (region, block index). region is pre | block | post | outside (a graph with no block)."""

    family: BlockFamily | None
    region: dict[str, str]
    block: dict[str, int | None]

    @property
    def n_blocks(self) -> int:
        return self.family.n_blocks if self.family else 0

    @property
    def blocks_in_graph(self) -> list[int]:
        return sorted({b for b in self.block.values() if b is not None})

    def to_json(self) -> dict[str, Any]:
        return {
            "family": dataclasses.asdict(self.family) if self.family else None,
            "nodes": {name: {"region": self.region[name], "block": self.block[name]} for name in self.region},
        }


def find_block_family(model: nn.Module | None) -> BlockFamily | None:
    """The model's block list (see the module docstring), or None."""
    if model is None:
        return None
    no_split = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    candidates = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) == 0:
            continue
        types = {type(child) for child in container}
        if len(types) != 1 or not any(True for _ in container[0].children()):
            continue  # mixed types (Sequential(Linear, ReLU, ...)) or leaf modules are no transformer blocks
        type_name = types.pop().__name__
        score = (type_name in no_split, len(container), -name.count("."))
        candidates.append((score, name, type_name, len(container)))
    if not candidates:
        return None
    (named, _, _), parent, type_name, n = max(candidates)
    if not named and n < 2:
        return None
    return BlockFamily(parent=parent, type_name=type_name, n_blocks=n)


def _stack_paths(node: fx.Node, roots: FrameRoots) -> list[tuple[str, ...]]:
    """The node's module stack, outermost first, as qualified path tokens."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else value
        name = qualified_name(str(path), roots.paths)
        paths.append(tuple(name.split(".")) if name else ())
    return paths


def open_modules(dynamo_gm: fx.GraphModule, roots: FrameRoots) -> list[nn.Module]:
    """The modules whose forward a graph break interrupted at this graph's end: the frame's own (its `self`, as
    Dynamo holds it) and the module stack of its last op. Python runs the rest of their forward, which Dynamo may
    not compile (a loop over data-dependent values), so their own parameters may be read outside any compiled
    graph. Empty where the frame returned."""
    reason = getattr(dynamo_gm, "compile_subgraph_reason", None)
    if reason is None or not reason.graph_break:
        return []
    modules = [m for m in [frame_self()] if m is not None]
    ops = [n for n in dynamo_gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    for path in _stack_paths(ops[-1], roots) if ops and roots.model is not None else ():
        try:
            modules.append(roots.model.get_submodule(".".join(path)))
        except AttributeError:
            continue
    return modules


def frame_self() -> nn.Module | None:
    """The module whose method Dynamo is compiling now (the frame's `self`), where its translator says. Dynamo's
    internals: nothing where they differ."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx() if hasattr(InstructionTranslator, "current_tx") else None
    local = getattr(tx, "symbolic_locals", {}).get("self")
    value = getattr(local, "value", None)
    return value if isinstance(value, nn.Module) else None


def block_index(path: Sequence[str], family: BlockFamily) -> int | None:
    """The block a module or parameter path (split on dots) lies in: `i` when it passes through `<list>.<i>`."""
    parent = family.parent.split(".") if family.parent else []
    n = len(parent)
    if len(path) > n and list(path[:n]) == parent and path[n].isdigit():
        return int(path[n])
    return None


def is_backward(node: fx.Node) -> bool:
    """A joint-graph node of the backward (AOTAutograd's tag)."""
    return node.meta.get("partitioner_tag") == "is_backward"


def _inherited_block(node: fx.Node, block: dict[str, int | None], backward: bool, previous: int | None) -> int | None:
    """Block of a node with no module stack (AOT-made views, detaches, backward helpers): that of its inputs,
    the latest block in forward and the earliest in backward (gradients flow from later blocks to earlier
    ones); with no input in a block, that of the node before it."""
    inputs = [block[n.name] for n in node.all_input_nodes if block.get(n.name) is not None]
    if not inputs:
        return previous
    return min(inputs) if backward else max(inputs)


def _module_order(model: nn.Module | None) -> dict[tuple[str, ...], int]:
    if model is None:
        return {}
    return {tuple(name.split(".")) if name else (): i for i, (name, _) in enumerate(model.named_modules())}


def build_block_map(joint: fx.GraphModule, roots: FrameRoots) -> BlockMap:
    """Map every node of the joint graph to its transformer block (see the module docstring)."""
    family = find_block_family(roots.model)
    nodes = [n for n in joint.graph.nodes if n.op not in ("placeholder", "output")]
    block: dict[str, int | None] = {n.name: None for n in joint.graph.nodes}
    region: dict[str, str] = {n.name: (PRE if n.op == "placeholder" else POST) for n in joint.graph.nodes}
    if family is None:
        region.update({n.name: OUTSIDE for n in nodes})
        log.info("no transformer blocks in a graph of %d nodes; it is one region", len(nodes))
        return BlockMap(family=None, region=region, block=block)

    parent = tuple(family.parent.split(".")) if family.parent else ()
    order = _module_order(roots.model)
    parent_order = order.get(parent, 0)
    previous_block: dict[bool, int | None] = {False: None, True: None}
    seen_block = {False: False, True: False}  # forward runs pre, blocks, post; backward post, blocks, pre
    for node in nodes:
        backward = is_backward(node)
        paths = _stack_paths(node, roots)
        idx = next((b for p in paths if (b := block_index(p, family)) is not None), None)
        if idx is None and not paths:
            idx = _inherited_block(node, block, backward, previous_block[backward])
        block[node.name] = previous_block[backward] = idx
        seen_block[backward] |= idx is not None
        inner = paths[-1] if paths else None
        if idx is not None:
            region[node.name] = BLOCK
        elif inner in order and inner[: len(parent)] != parent[: len(inner)]:
            # a module outside the block list: before or after the list in the model
            region[node.name] = PRE if order[inner] < parent_order else POST
        else:
            # no module, or one holding the list: by position relative to the blocks in execution order
            region[node.name] = (PRE if backward else POST) if seen_block[backward] else (POST if backward else PRE)
    block_map = BlockMap(family=family, region=region, block=block)
    log.info(
        "graph holds blocks %s of %d %s blocks under %s",
        block_map.blocks_in_graph,
        family.n_blocks,
        family.type_name,
        family.parent or "<root>",
    )
    return block_map


def check_inputs(dynamo_gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Reject what the backend cannot handle, with a message that says what to do."""
    if any(isinstance(x, torch.SymInt) for x in example_inputs) or any(
        isinstance(n.meta.get("example_value"), torch.SymInt) for n in dynamo_gm.graph.nodes if n.op == "placeholder"
    ):
        raise ValueError(
            "protrain plans memory for fixed shapes, but this graph has dynamic (symbolic) sizes. Compile with "
            "`torch.compile(model, backend='protrain', dynamic=False)` (each new batch or sequence size then "
            "gets its own compile and plan), or pad inputs to one fixed shape."
        )
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and any(isinstance(x, nn.Parameter) for x in tensors):
        if not any(x.requires_grad for x in tensors):
            raise ValueError(
                "the model has no trainable parameters (none requires grad) and the forward runs with gradients "
                "enabled: protrain plans training steps. Unfreeze the parameters to train (p.requires_grad_(True)), "
                "or run inference under torch.no_grad()"
            )
    params = {x.device for x in tensors if isinstance(x, nn.Parameter)}
    others = {x.device for x in tensors if not isinstance(x, nn.Parameter) and x.numel() > 1}
    if len(params) > 1:
        raise ValueError(f"model parameters are on several devices {sorted(map(str, params))}; move them to one")
    if params and others and others != params:
        raise ValueError(
            f"model parameters are on {next(iter(params))} but inputs are on {sorted(map(str, others))}; "
            "move the inputs to the parameters' device (or the model to the inputs')"
        )
