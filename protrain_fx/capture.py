"""Capture: what each compiled graph holds, read once from the graphs themselves.

Two maps are built per graph and kept on its `GraphRecord`:

- the parameter map: each parameter placeholder -> the `nn.Parameter`, its qualified name and its first use
  in execution order. Parameters are matched to Dynamo's example inputs by identity (a tied weight is one
  input, so one entry); the qualified name is read off the placeholder's Dynamo source, whose prefix differs
  between torch versions (`L['self']...` vs `L['args'][0]...`), so only the part after it is kept.
- the block map: each node of the joint (forward + backward) graph -> the transformer block it belongs to.
  Blocks are found from `nn_module_stack` with no per-model code: the children `<parent>.<i>` of one module
  list, all of one type. Hugging Face models name that type in `_no_split_modules`, which wins when present;
  otherwise the family with the most indices does. Backward nodes carry the stack of the forward op they
  differentiate; nodes with no stack take the block of their inputs (see `_inherited_block`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

log = logging.getLogger(__name__)

PRE, POST, OUTSIDE, BLOCK = "pre", "post", "outside", "block"

_SOURCE_PREFIX = re.compile(r"^L\[[^\]]+\](\[\d+\])?")
_SOURCE_TOKEN = re.compile(r"\['([^'\]]+)'\]|\.(\w+)|\[(\d+)\]")
_CONTAINER_TOKENS = {"_modules", "_parameters", "_buffers"}


def qualified_name(source_text: str) -> str:
    """`L['args'][0]._modules['model']._modules['layers']._modules['0']._parameters['weight']` -> `model.layers.0.weight`.

    Also accepts Dynamo's short module paths such as `L['self'].model.layers[0].mlp`.
    """
    rest = _SOURCE_PREFIX.sub("", source_text)
    tokens = [next(g for g in m.groups() if g is not None) for m in _SOURCE_TOKEN.finditer(rest)]
    return ".".join(t for t in tokens if t not in _CONTAINER_TOKENS)


def _source_text(placeholder: fx.Node) -> str | None:
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else str(name)


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
    dynamo_gm: fx.GraphModule, example_inputs: Sequence[Any], joint: fx.GraphModule
) -> dict[str, ParamEntry]:
    """Parameter map of one graph: AOT primal placeholder name -> ParamEntry (with `.param` kept aside)."""
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
            name=qualified_name(source) if source else ph.name,
            shape=tuple(value.shape),
            dtype=str(value.dtype).removeprefix("torch."),
            first_use=users[0].name if users else None,
            first_use_index=order[users[0]] if users else None,
        )
    return entries


@dataclasses.dataclass(frozen=True)
class BlockFamily:
    """The repeated blocks of a model: `<parent>.<index>` modules of one type."""

    parent: str  # e.g. model.layers
    type_name: str  # e.g. LlamaDecoderLayer
    indices: tuple[int, ...]  # block indices seen in this graph


@dataclasses.dataclass(frozen=True)
class BlockMap:
    """Node name -> (region, block index). region is pre | block | post | outside (a graph with no block)."""

    family: BlockFamily | None
    region: dict[str, str]
    block: dict[str, int | None]

    @property
    def n_blocks(self) -> int:
        return len(self.family.indices) if self.family else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "family": dataclasses.asdict(self.family) if self.family else None,
            "nodes": {name: {"region": self.region[name], "block": self.block[name]} for name in self.region},
        }


def _stack_entries(node: fx.Node) -> list[tuple[tuple[str, ...], type | None]]:
    """The node's module stack, outermost first, as (path tokens, module type)."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = []
    for value in stack.values():
        path, typ = value if isinstance(value, tuple) else (value, None)
        if isinstance(typ, str):  # some versions keep the type's qualified name
            typ = None
        entries.append((tuple(qualified_name(str(path)).split(".")) if path else (), typ))
    return entries


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def _find_family(nodes: Sequence[fx.Node]) -> BlockFamily | None:
    families: dict[tuple[tuple[str, ...], str], set[int]] = {}
    types_under: dict[tuple[str, ...], set[str]] = {}  # parent -> types of its indexed children
    has_submodules: set[tuple[str, ...]] = set()  # indexed modules with modules of their own inside
    no_split: set[str] = set()
    for node in nodes:
        entries = _stack_entries(node)
        for depth, (path, typ) in enumerate(entries):
            if typ is not None:
                no_split.update(getattr(typ, "_no_split_modules", None) or ())
            if path and path[-1].isdigit() and typ is not None:
                families.setdefault((path[:-1], typ.__name__), set()).add(int(path[-1]))
                types_under.setdefault(path[:-1], set()).add(typ.__name__)
                if depth + 1 < len(entries):
                    has_submodules.add(path[:-1])
    # a block list holds one type of module with modules inside (not e.g. Sequential(Linear, ReLU, Linear))
    families = {key: idx for key, idx in families.items() if len(types_under[key[0]]) == 1 and key[0] in has_submodules}
    if not families:
        return None

    def score(item):
        (parent, type_name), indices = item
        return (type_name in no_split, len(indices), -len(parent))

    (parent, type_name), indices = max(families.items(), key=score)
    if type_name not in no_split and len(indices) < 2:
        return None
    return BlockFamily(parent=".".join(parent), type_name=type_name, indices=tuple(sorted(indices)))


def _inherited_block(node: fx.Node, block: dict[str, int | None], backward: bool, previous: int | None) -> int | None:
    """Block of a node with no module stack (AOT-made views, detaches, backward helpers): that of its inputs,
    the latest block in forward and the earliest in backward (gradients flow from later blocks to earlier
    ones); with no input in a block, that of the node before it."""
    inputs = [block[n.name] for n in node.all_input_nodes if block.get(n.name) is not None]
    if not inputs:
        return previous
    return min(inputs) if backward else max(inputs)


def build_block_map(joint: fx.GraphModule) -> BlockMap:
    """Map every node of the joint graph to its transformer block (see the module docstring)."""
    nodes = [n for n in joint.graph.nodes if n.op not in ("placeholder", "output")]
    family = _find_family(nodes)
    parent = tuple(family.parent.split(".")) if family else None
    block: dict[str, int | None] = {}
    module_region: dict[tuple[str, ...], str] = {}  # innermost non-block module path -> pre/post (forward order)
    seen_block = False
    previous: dict[bool, int | None] = {False: None, True: None}
    for node in nodes:
        backward = _is_backward(node)
        idx = None
        entries = _stack_entries(node)
        for path, _ in entries:
            if parent and len(path) == len(parent) + 1 and path[:-1] == parent and path[-1].isdigit():
                idx = int(path[-1])
        if idx is None and not entries:
            idx = _inherited_block(node, block, backward, previous[backward])
        block[node.name] = idx
        previous[backward] = idx
        if not backward:
            seen_block |= idx is not None
            if idx is None and entries:
                module_region.setdefault(entries[-1][0], POST if seen_block else PRE)

    region: dict[str, str] = {}
    for node in joint.graph.nodes:
        if node.op in ("placeholder", "output"):
            region[node.name] = PRE if node.op == "placeholder" else POST
            block[node.name] = None
            continue
        if family is None:
            region[node.name] = OUTSIDE
        elif block[node.name] is not None:
            region[node.name] = BLOCK
        else:
            entries = _stack_entries(node)
            region[node.name] = module_region.get(entries[-1][0], POST) if entries else POST
    # forward nodes with no stack before the first block node are "pre", after it "post"
    if family is not None:
        seen = False
        for node in nodes:
            if _is_backward(node):
                continue
            if block[node.name] is not None:
                seen = True
            elif not _stack_entries(node):
                region[node.name] = POST if seen else PRE
    if family is None:
        log.info("no transformer blocks in a graph of %d nodes; it is one region", len(nodes))
    else:
        log.info("found %d blocks of %s under %s", len(family.indices), family.type_name, family.parent or "<root>")
    return BlockMap(family=family, region=region, block=block)


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
    params = {x.device for x in tensors if isinstance(x, nn.Parameter)}
    others = {x.device for x in tensors if not isinstance(x, nn.Parameter) and x.numel() > 1}
    if len(params) > 1:
        raise ValueError(f"model parameters are on several devices {sorted(map(str, params))}; move them to one")
    if params and others and others != params:
        raise ValueError(
            f"model parameters are on {next(iter(params))} but inputs are on {sorted(map(str, others))}; "
            "move the inputs to the parameters' device (or the model to the inputs')"
        )
