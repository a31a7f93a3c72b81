"""Capture: what each compiled graph holds, read once from the graphs and the model they come from.

Two maps are built per graph and kept on its `GraphRecord`:

- the parameter map: each parameter placeholder -> the `nn.Parameter`, its qualified name and its first use
  in execution order. Parameters are matched to Dynamo's example inputs by identity (a tied weight is one
  input, so one entry).
- the block map: each node of the joint (forward + backward) graph -> the transformer block it belongs to.

Both need to know where the compiled frame sits in the model. A graph break can start a graph inside a
decoder layer (OPT on torch 2.11 compiles each layer as its own graph, with the layer as `L['self']`), so
Dynamo's sources and module stacks are relative to the frame's locals. `find_frame_roots` finds one
parameter of each local among the parameters of the outermost module the frame reaches: its locals and the
globals its sources name, as Dynamo's translator holds them, and the modules whose call is running (a layer's
frame is called from its model's call), torch.compile's and DDP's wrappers looked through. That gives the model
and every source's full qualified name, without the garbage collector (whose every object would be read at each
compile, and which a `gc.freeze()`d model is out of).
The blocks are then read off the model with no per-model code: every `ModuleList` (or `Sequential`) of
repeated children of one type with modules inside, outermost lists only (an MoE block's list of experts is
inside a block). Hugging Face models name their block types in `_no_split_modules`: where they do, the lists of
those types are the blocks (T5's `encoder.block` and `decoder.block`, BART's encoder and decoder layers),
otherwise every list of two or more. Blocks are numbered list after list in the order the forward first runs
each list (an encoder's blocks before its decoder's), so block `i` is one index in the plan's `block_modes`
whatever list it comes from. A node belongs to a block when its `nn_module_stack` passes through
`<list>.<i>`; backward nodes carry the stack of the forward op they differentiate; nodes with no stack take
the block of their inputs (see `_inherited_block`). Nodes in no block are counted per region (before the
first list, between two, after the last) and logged, with a warning where they are most of the graph
(`OUTSIDE_WARN_SHARE`).

A parameter outside the blocks that the forward reads again after blocks ran (a tied embedding, read by the
head at the end; T5's shared embedding, read by the encoder, the decoder and the head) records where
(`ParamEntry.read_again_at`): the chunk layout gives it a chunk of its own, and the planner prices the
gathers again.

One module for the stage: both maps stand on the frame roots and Dynamo's source names read here, as told above.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import torch
from torch import fx, nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

PRE, POST, OUTSIDE, BLOCK, BETWEEN = "pre", "post", "outside", "block", "between"
# a graph running blocks with more than this share of its nodes in none gets a warning: the lists may miss some
# (a graph of the head alone, after a graph break, runs no block and gets none)
OUTSIDE_WARN_SHARE = 0.5

# a frame's local (`L['self']`, `L['args'][0]`) or a global its code reads (`G['model']`)
_SOURCE_PREFIX = re.compile(r"^[LG]\[[^\]]+\](\[\d+\])?")
_GLOBAL_NAME = re.compile(r"^G\['([^']+)'\]")
_SOURCE_TOKEN = re.compile(r"\['([^'\]]+)'\]|\.(\w+)|\[(\d+)\]")
# (Dynamo reaches some submodules through `__dict__['_modules']`)
_CONTAINER_TOKENS = {"_modules", "_parameters", "_buffers", "__dict__"}


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


def _frame_modules(prefixes: Sequence[str]) -> list[Any]:
    """What the compiled frame's locals are, as Dynamo's translator holds them: every local and the items of a
    local list or tuple (a frame's sources start at `L['self']`, `L['args'][0]`), and the globals its sources
    start at (`G['model']`: a compiled function calling a model it reads from its module). Nothing where
    Dynamo's internals differ."""
    tx = _translator()
    f_locals, f_globals = getattr(tx, "f_locals", None) or {}, getattr(tx, "f_globals", None) or {}
    values = [*f_locals.values(), *(f_globals.get(m.group(1)) for p in prefixes if (m := _GLOBAL_NAME.match(p)))]
    return [*values, *(item for v in values if type(v) in (list, tuple) for item in v)]


def _modules_being_called() -> Iterator[Any]:
    """The modules whose call runs on this thread now, innermost first: the `self` of each `nn.Module.__call__`
    frame below the compiled one. A frame that starts inside a block (a graph break there, or each block compiled
    on its own) is called from its model's call. Only those frames' locals are read: reading another frame's
    would keep a copy of them alive until it returns (on Python before 3.13), a training loop's for the whole run."""
    calls = {f.__code__ for name in ("_call_impl", "_wrapped_call_impl") if (f := getattr(nn.Module, name, None))}
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code in calls:
            yield frame.f_locals.get("self")
        frame = frame.f_back


def _unwrapped(value: Any) -> nn.Module | None:
    """The module `value` is, under torch.compile's wrapper and `DistributedDataParallel` (names are the model's
    own, as in its state_dict); None for anything else, and for FX graphs (Dynamo's own, on the stack)."""
    # (type(), not isinstance: isinstance reads `__class__`, which a weak proxy to a dead object raises on)
    while issubclass(type(value), (OptimizedModule, DistributedDataParallel)):
        value = value._orig_mod if issubclass(type(value), OptimizedModule) else value.module
    if not issubclass(type(value), nn.Module) or issubclass(type(value), fx.GraphModule):
        return None
    return value if "_modules" in value.__dict__ else None  # (a module whose __init__ has not run has none)


def _parameter_names(prefixes: Sequence[str]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every parameter of the modules the compiled frame reaches (by id) -> (outermost of those modules holding
    it, its qualified name there), one entry per name (a tied weight has several).

    The modules are the frame's locals and the modules being called (`_frame_modules`, `_modules_being_called`);
    the outermost are those none of the others holds. Read from Dynamo's translator and the Python stack, not from
    the garbage collector: the cost does not grow with the process, and a model `gc.freeze()` moved out of the
    collector's view is found as any other."""
    found: dict[int, nn.Module] = {}
    for value in itertools.chain(_frame_modules(prefixes), _modules_being_called()):
        module = _unwrapped(value)
        if module is not None:
            found.setdefault(id(module), module)
    inner = {id(m) for root in found.values() for m in root.modules() if m is not root}
    names: dict[int, list[tuple[nn.Module, str]]] = {}
    for root in (m for key, m in found.items() if key not in inner):
        for name, param in root.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append((root, name))
    return names


def _translator() -> Any:
    """Dynamo's translator of the frame it is compiling now; None outside a compile, or where its internals
    differ."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx()
    except AttributeError:  # (no frame being compiled on this thread, or no such method in this torch)
        return None


@dataclasses.dataclass
class FrameRoots:
    """Where the compiled frame's locals sit in the model (see the module docstring)."""

    model: nn.Module | None = None
    paths: dict[str, str] = dataclasses.field(default_factory=dict)  # source prefix -> path in the model


def find_frame_roots(dynamo_gm: fx.GraphModule, example_inputs: Sequence[Any]) -> FrameRoots:
    placeholders = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    params = [
        (_split_source(text), value)
        for ph, value in zip(placeholders, example_inputs)
        if isinstance(value, nn.Parameter) and (text := _source_text(ph)) is not None
    ]
    roots = FrameRoots()
    names = _parameter_names([prefix for (prefix, _), _ in params]) if params else {}
    for (prefix, relative), value in params:
        if prefix in roots.paths:
            continue
        located = next(((m, n) for m, n in names.get(id(value), ()) if _ends_with(n, relative)), None)
        if located is None:
            continue
        roots.model, full = located
        roots.paths[prefix] = full[: len(full) - len(relative)].rstrip(".")
    return roots


def _ends_with(name: str, relative: str) -> bool:
    """Qualified name `name` ends with the path `relative` (whole names: `blocks.10.weight` does not end with
    `0.weight`)."""
    return not relative or name == relative or name.endswith("." + relative)


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
    # where the forward reads it again after other blocks ran since its last read (only for parameters outside
    # the blocks): in or before block b (b), after the last block (its index + 1); e.g. a tied embedding read
    # by the head of an 8-block model: (8,)
    read_again_at: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_param_map(
    dynamo_gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    joint: fx.GraphModule,
    roots: FrameRoots,
    block_map: BlockMap | None = None,
) -> dict[str, ParamEntry]:
    """Parameter map of one graph: AOT primal placeholder name -> ParamEntry (`read_again_at` with a block map)."""
    dynamo_phs = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    assert len(dynamo_phs) == len(example_inputs), "Dynamo placeholders and example inputs differ in number"
    assert len(primals) == len(example_inputs), (
        f"joint graph has {len(primals)} primals for {len(example_inputs)} inputs; AOT added inputs we cannot map"
    )
    order = {n: i for i, n in enumerate(joint.graph.nodes)}
    forward = [n for n in joint.graph.nodes if n.op not in ("placeholder", "output") and not is_backward(n)]
    position = {n: i for i, n in enumerate(forward)}
    entries: dict[str, ParamEntry] = {}
    names = _names_in(roots.model)
    for i, (ph, value, primal) in enumerate(zip(dynamo_phs, example_inputs, primals)):
        if not isinstance(value, nn.Parameter):
            continue
        source = _source_text(ph)
        name = qualified_name(source, roots.paths) if source else ph.name
        if names.get(id(value)) and name not in names[id(value)]:  # a source form the parser does not know
            name = names[id(value)][0]
        users = sorted(primal.users, key=order.__getitem__)
        again = ()
        if block_map is not None and block_map.families and block_map.block_of(name) is None:
            readers = [u for u in users if u in position]
            again = _read_again_at(readers, forward, position, block_map.block)
        entries[primal.name] = ParamEntry(
            index=i,
            placeholder=primal.name,
            name=name,
            shape=tuple(value.shape),
            dtype=str(value.dtype).removeprefix("torch."),
            first_use=users[0].name if users else None,
            first_use_index=order[users[0]] if users else None,
            read_again_at=again,
        )
    return entries


def _names_in(model: nn.Module | None) -> dict[int, list[str]]:
    """Each parameter of `model` (by id) -> its qualified names (a tied one has several)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False) if model is not None else ():
        names.setdefault(id(param), []).append(name)
    return names


def _read_again_at(
    readers: list[fx.Node], forward: list[fx.Node], position: dict[fx.Node, int], block: dict[str, int | None]
) -> tuple[int, ...]:
    """Where the `readers` of a parameter (forward nodes in graph order) start reading it again after other
    blocks ran: the block a later stretch of reads runs in or before (the last block + 1 after it)."""
    places, reached = set(), -1
    for node in forward[: position[readers[0]]] if readers else ():
        reached = max(reached, block[node.name] if block[node.name] is not None else -1)
    for before, after in zip(readers, readers[1:]):
        own = {block[before.name], block[after.name]}
        ran = False
        for node in forward[position[before] + 1 : position[after]]:
            b = block[node.name]
            if b is not None:
                reached = max(reached, b)
                ran = ran or b not in own
        if ran:
            places.add(block[after.name] if block[after.name] is not None else reached + 1)
    return tuple(sorted(places))


@dataclasses.dataclass(frozen=True)
class BlockFamily:
    """One list of repeated blocks: the children `<parent>.<i>` of one module list, all of one type. Its blocks are
    `first` .. `first + n_blocks - 1` among the model's blocks (those of every list, list after list)."""

    parent: str  # e.g. model.layers, or encoder.block
    type_name: str  # e.g. LlamaDecoderLayer
    n_blocks: int  # blocks in the list (a graph may hold only some of them)
    first: int = 0  # index of the list's block 0 among the model's blocks


@dataclasses.dataclass(frozen=True)
class BlockMap:
    """Node name -> (region, block index), and the block lists the indices count through.

    region is pre | block | between | post, or outside (a model with no block list: one region). `outside` counts
    the joint graph's computing nodes (neither placeholder nor output) in no block, per region; `n_nodes` counts
    them all."""

    families: tuple[BlockFamily, ...]
    region: dict[str, str]
    block: dict[str, int | None]
    outside: dict[str, int] = dataclasses.field(default_factory=dict)
    n_nodes: int = 0

    @property
    def n_blocks(self) -> int:
        return sum(f.n_blocks for f in self.families)

    @property
    def n_outside(self) -> int:
        return sum(self.outside.values())

    @property
    def blocks_in_graph(self) -> list[int]:
        return sorted({b for b in self.block.values() if b is not None})

    def block_of(self, name: str) -> int | None:
        """The block of a parameter or module by its qualified name; None outside every block."""
        return block_index(name.split("."), self.families)

    def needed_from(self, backward: fx.Graph) -> dict[str, int]:
        """Saved value (a backward graph's input) -> the highest block whose nodes read it in that backward: the
        backward needs it from that block on (values no block reads are left out)."""
        readers = {}
        for ph in backward.find_nodes(op="placeholder"):
            blocks = [b for u in ph.users if (b := self.block.get(u.name)) is not None]
            if blocks:
                readers[ph.name] = max(blocks)
        return readers

    def describe(self) -> str:
        """The block lists found and the nodes outside them, in one line."""
        if not self.families:
            return f"no block list: all {self.n_nodes} graph nodes are one region"
        lists = ", ".join(
            f"{f.parent or '<root>'} ({f.n_blocks} x {f.type_name}, blocks {f.first}-{f.first + f.n_blocks - 1})"
            for f in self.families
        )
        where = ", ".join(f"{region} {n}" for region, n in self.outside.items() if n)
        return f"block lists {lists}; {self.n_outside} of {self.n_nodes} graph nodes outside them ({where or 'none'})"

    def to_json(self) -> dict[str, Any]:
        return {
            "families": [dataclasses.asdict(f) for f in self.families],
            "outside": dict(self.outside),
            "n_nodes": self.n_nodes,
            "nodes": {name: {"region": self.region[name], "block": self.block[name]} for name in self.region},
        }


def find_block_families(model: nn.Module | None) -> tuple[BlockFamily, ...]:
    """The model's block lists (see the module docstring), numbered in registration order; () when it has none."""
    if model is None:
        return ()
    no_split = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    candidates = []  # (path, type name, length)
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) == 0:
            continue
        types = {type(child) for child in container}
        if len(types) != 1 or not any(True for _ in container[0].children()):
            continue  # mixed types (Sequential(Linear, ReLU, ...)) or leaf modules are no transformer blocks
        candidates.append((name, types.pop().__name__, len(container)))
    chosen = [c for c in candidates if c[1] in no_split] or [c for c in candidates if c[2] >= 2]
    outermost = [c for c in chosen if not any(_inside(c[0], other[0]) for other in chosen if other is not c)]
    return _numbered(BlockFamily(parent=name, type_name=type_name, n_blocks=n) for name, type_name, n in outermost)


def _inside(path: str, parent: str) -> bool:
    """Module `path` lies strictly inside module `parent` (qualified names; "" is the model)."""
    return path != parent and (parent == "" or path.startswith(parent + "."))


def _numbered(families) -> tuple[BlockFamily, ...]:
    """The lists in this order, their blocks numbered one list after the other."""
    numbered, first = [], 0
    for family in families:
        numbered.append(dataclasses.replace(family, first=first))
        first += family.n_blocks
    return tuple(numbered)


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
    local = getattr(_translator(), "symbolic_locals", {}).get("self")
    value = getattr(local, "value", None)
    return value if isinstance(value, nn.Module) else None


def block_index(path: Sequence[str], families: Sequence[BlockFamily]) -> int | None:
    """The block a module or parameter path (split on dots) lies in: `first + i` of the list whose `<parent>.<i>`
    it passes through."""
    for family in families:
        parent = family.parent.split(".") if family.parent else []
        n = len(parent)
        if len(path) > n and list(path[:n]) == parent and path[n].isdigit():
            return family.first + int(path[n])
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


def _in_execution_order(
    families: tuple[BlockFamily, ...], nodes: list[fx.Node], paths: dict[str, list[tuple[str, ...]]]
) -> tuple[BlockFamily, ...]:
    """The lists in the order the forward first runs one of their blocks (lists this graph does not run last,
    in registration order), renumbered: checkpointing, swapping and the cost model count blocks in execution
    order (an encoder's before its decoder's, a vision tower's before a text model's it runs first)."""
    first_run: dict[int, int] = {}
    for position, node in enumerate(nodes):
        if len(first_run) == len(families) or is_backward(node):
            break
        for path in paths[node.name]:
            for k, family in enumerate(families):
                if k not in first_run and block_index(path, (family,)) is not None:
                    first_run[k] = position
    order = sorted(range(len(families)), key=lambda k: (first_run.get(k, len(nodes)), k))
    return _numbered(families[k] for k in order)


def _related(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """One module path holds the other (or they are the same)."""
    return a[: len(b)] == b[: len(a)]


def _regions(
    nodes: list[fx.Node],
    block: dict[str, int | None],
    paths: dict[str, list[tuple[str, ...]]],
    parents: list[tuple[str, ...]],
    order: dict[tuple[str, ...], int],
) -> dict[str, str]:
    """The region of each node. In a block: block. Otherwise by where it runs among the block nodes of its graph
    (the forward runs pre, blocks, post, with between where block nodes come before and after it; the backward
    the other way round); a backward node of a module outside every list takes the region of that module's
    forward. Where a graph runs no block, a module outside every list goes by its registration among the lists
    (before all of them: pre, after all: post, else between): a head after a graph break is post."""
    spans: dict[bool, tuple[int, int]] = {}
    for i, node in enumerate(nodes):
        if block[node.name] is not None:
            first, _ = spans.get(is_backward(node), (i, i))
            spans[is_backward(node)] = (first, i)
    parent_orders = [order.get(p, 0) for p in parents]
    module_region: dict[tuple[str, ...], str] = {}
    region: dict[str, str] = {}
    for i, node in enumerate(nodes):
        backward = is_backward(node)
        inner = paths[node.name][-1] if paths[node.name] else None
        if inner is not None and (inner not in order or any(_related(inner, p) for p in parents)):
            inner = None  # no module of the model, or one holding a list: its place says nothing
        if block[node.name] is not None:
            region[node.name] = BLOCK
        elif backward and inner in module_region:
            region[node.name] = module_region[inner]
        elif inner is not None and backward not in spans:
            at = order[inner]
            region[node.name] = PRE if at < min(parent_orders) else POST if at > max(parent_orders) else BETWEEN
        else:
            first, last = spans.get(backward, (len(nodes), len(nodes)))
            before, after = (POST, PRE) if backward else (PRE, POST)
            region[node.name] = before if i < first else after if i > last else BETWEEN
        if not backward and inner is not None:
            module_region.setdefault(inner, region[node.name])
    return region


def build_block_map(joint: fx.GraphModule, roots: FrameRoots) -> BlockMap:
    """Map every node of the joint graph to its transformer block (see the module docstring)."""
    nodes = [n for n in joint.graph.nodes if n.op not in ("placeholder", "output")]
    block: dict[str, int | None] = {n.name: None for n in joint.graph.nodes}
    region: dict[str, str] = {n.name: (PRE if n.op == "placeholder" else POST) for n in joint.graph.nodes}
    families = find_block_families(roots.model)
    if not families:
        region.update({n.name: OUTSIDE for n in nodes})
        log.info("no transformer blocks in a graph of %d nodes; it is one region", len(nodes))
        return BlockMap(families=(), region=region, block=block, outside={OUTSIDE: len(nodes)}, n_nodes=len(nodes))

    paths = {n.name: _stack_paths(n, roots) for n in nodes}
    families = _in_execution_order(families, nodes, paths)
    previous_block: dict[bool, int | None] = {False: None, True: None}
    for node in nodes:
        backward = is_backward(node)
        idx = next((b for p in paths[node.name] if (b := block_index(p, families)) is not None), None)
        if idx is None and not paths[node.name]:
            idx = _inherited_block(node, block, backward, previous_block[backward])
        block[node.name] = previous_block[backward] = idx
    parents = [tuple(f.parent.split(".")) if f.parent else () for f in families]
    region.update(_regions(nodes, block, paths, parents, _module_order(roots.model)))
    outside = {r: sum(1 for n in nodes if block[n.name] is None and region[n.name] == r) for r in (PRE, BETWEEN, POST)}
    block_map = BlockMap(families=families, region=region, block=block, outside=outside, n_nodes=len(nodes))
    log.info("graph holds blocks %s; %s", block_map.blocks_in_graph, block_map.describe())
    if block_map.blocks_in_graph and block_map.n_outside > OUTSIDE_WARN_SHARE * len(nodes):
        log.warning(
            "%s: more than %.0f%% of the graph is in no block, so per-block checkpointing and swapping reach little "
            "of it; if the model has other repeated layers, name their class in its `_no_split_modules`",
            block_map.describe(),
            100 * OUTSIDE_WARN_SHARE,
        )
    return block_map


def check_inputs(dynamo_gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Reject what the backend cannot handle, with a message that says what to do."""
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
