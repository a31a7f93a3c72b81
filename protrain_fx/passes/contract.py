"""The pass contract: what a pass reads (`PassContext`, whose run-time objects are typed as Protocols, since the
passes import nothing of runtime/ or backend/) and what it declares (`graph_pass`): the graphs it rewrites, the
context fields and graph tags it requires, the tags it provides. `check_order` holds a pipeline to those
declarations when it is built (pipeline.py), so a pass placed before the one that tags what it reads, or given a
context without a field it reads, fails at import with the pass and the field named, not deep inside a compile.

    @graph_pass(graphs=(FORWARD, BACKWARD), requires=("manager",), requires_tags=(TAG,), provides=(RELEASES,))
    def chunk_gather_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule: ...

A graph tag is what a pass leaves in a graph for the passes after it: a `node.meta` key ("protrain_param") or the
ops it inserts ("protrain.release"). Tags of the joint graph reach the forward and backward graphs, whose nodes the
partitioner copies with their meta; a backward pass reads the forward graph's tags through `forward_placeholders`
and `forward_outputs` (`requires_forward_tags`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import fx

from protrain_fx.capture import BlockMap, ParamEntry
from protrain_fx.config import ProTrainConfig
from protrain_fx.planner.chunking import Slot
from protrain_fx.planner.plan import Plan

JOINT, FORWARD, BACKWARD = "joint", "forward", "backward"  # the graphs a pass rewrites (`PassContext.stage`)
INFERENCE = "inference"  # the context of a forward graph compiled under no_grad (backend/inference.py)
# torch's activation checkpointing tags (node.meta keys), which its partitioner reads: a pass's tags like any other
RECOMPUTE, AC_GRAPH_ID = "recompute", "ac_graph_id"


class ChunkManagerLike(Protocol):
    """What the passes read of the model's ChunkManager (runtime/chunks/): the handle its ops take, and where each
    parameter it holds lies."""

    @property
    def handle(self) -> int: ...

    @property
    def index(self) -> Mapping[int, int]: ...  # id(parameter) -> its index in the manager

    @property
    def own_master(self) -> bool: ...  # the parameters are their chunks' master (no separate fp32 copy)

    @property
    def n_buffer(self) -> int: ...

    def holds(self, p: torch.nn.Parameter) -> bool: ...

    def is_persistent(self, p: torch.nn.Parameter) -> bool: ...

    def slot_of(self, p: torch.nn.Parameter) -> Slot: ...


class SwapSpaceLike(Protocol):
    """The graph's SwapSpace (runtime/swap.py), as the swap ops take it."""

    @property
    def handle(self) -> int: ...


class StepMonitorLike(Protocol):
    """The graph's StepMonitor (runtime/monitor.py), as the step and phase marks take it."""

    @property
    def handle(self) -> int: ...


class GraphRecordLike(Protocol):
    """What the passes read of the graph's GraphRecord (backend/record.py): the capture's maps."""

    @property
    def param_map(self) -> Mapping[str, ParamEntry]: ...

    @property
    def block_map(self) -> BlockMap | None: ...  # None for an inference graph's record


class DumperLike(Protocol):
    """The graph's Dumper (debug/dump.py): `run_passes` writes the graph after each pass."""

    def write_text(self, name: str, text: str) -> None: ...


@dataclasses.dataclass
class PassContext:
    """What every pass may read: the options, the plan and the capture record of the graph, the run-time objects
    its ops reach, and what the forward's rewrite left for the backward's. Which fields a context carries depends
    on the graph it is for (`CARRIED`); a pass declares those it reads (`graph_pass`)."""

    config: ProTrainConfig
    plan: Plan | None  # None: an inference graph of a model not trained yet
    record: GraphRecordLike
    dumper: DumperLike | None = None
    manager: ChunkManagerLike | None = None  # the model's ChunkManager, None when not chunked
    example_inputs: Sequence[Any] = ()  # the graph's real inputs (parameters by position)
    stage: str = ""  # joint | forward | backward: the graph being rewritten (run_passes sets it)
    forward_placeholders: Sequence[fx.Node] = ()  # the forward graph's inputs, for backward passes
    forward_outputs: Sequence[fx.Node] = ()  # the rewritten forward graph's outputs, for backward passes
    saved: frozenset[str] = frozenset()  # names of the values the forward saves for the backward
    # saved value -> the highest block whose backward reads it (capture.py BlockMap.needed_from)
    needed_from: Mapping[str, int] = dataclasses.field(default_factory=dict)
    swap: SwapSpaceLike | None = None  # the graph's SwapSpace, None when no block swaps
    monitor: StepMonitorLike | None = None  # the graph's StepMonitor: with a dump directory, or for the closed loop
    grad_source: int = 0  # the graph's frame, as the ChunkManager counts gradients (runtime/chunks/arrivals.py)


_JOINT_FIELDS = ("config", "plan", "record", "dumper", "manager", "example_inputs")
_FORWARD_FIELDS = (*_JOINT_FIELDS, "saved", "needed_from", "swap", "monitor", "grad_source")
# The fields each context carries (a field may still be None where its docstring says so, the manager of a model
# not chunked, say): backend/stages.py `rewrite` makes the joint graph's, adds the forward's fields for the forward
# graph and the rewritten forward's for the backward graph; backend/inference.py makes an inference graph's.
CARRIED: Mapping[str, frozenset[str]] = {
    JOINT: frozenset(_JOINT_FIELDS),
    FORWARD: frozenset(_FORWARD_FIELDS),
    BACKWARD: frozenset((*_FORWARD_FIELDS, "forward_placeholders", "forward_outputs")),
    INFERENCE: frozenset(("config", "record", "dumper", "manager", "example_inputs")),
}
_FIELDS = frozenset(f.name for f in dataclasses.fields(PassContext))
assert all(fields <= _FIELDS for fields in CARRIED.values()), "CARRIED names a field PassContext does not have"


def required_plan(ctx: PassContext) -> Plan:
    """The plan, which a pass that requires "plan" is given (an inference graph's context may have none)."""
    assert ctx.plan is not None, f"the {ctx.stage} graph's pass context has no plan"
    return ctx.plan


def required_block_map(ctx: PassContext) -> BlockMap:
    """The capture's block map of a training graph, which a pass that requires "record" is given."""
    block_map = ctx.record.block_map
    assert block_map is not None, f"the {ctx.stage} graph's record has no block map"
    return block_map


@dataclasses.dataclass(frozen=True)
class Contract:
    """What a pass declares (`graph_pass`)."""

    graphs: frozenset[str]  # those it rewrites (JOINT, FORWARD, BACKWARD): it returns any other unchanged
    requires: frozenset[str]  # the PassContext fields it reads
    requires_tags: frozenset[str]  # the tags it reads on the graph it rewrites
    requires_forward_tags: frozenset[str]  # those it reads on the rewritten forward graph (backward passes)
    provides: frozenset[str]  # the tags it leaves on the graph it rewrites


Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]
P = TypeVar("P", bound=Callable[..., fx.GraphModule])
_CONTRACT = "pass_contract"  # the attribute of a pass function that holds its Contract


def graph_pass(
    *,
    graphs: Iterable[str],
    requires: Iterable[str] = (),
    requires_tags: Iterable[str] = (),
    requires_forward_tags: Iterable[str] = (),
    provides: Iterable[str] = (),
) -> Callable[[P], P]:
    """Declare a pass's contract (the module docstring); the function is returned as it is, its contract kept on
    it (`contract_of`)."""
    contract = Contract(
        graphs=frozenset(graphs),
        requires=frozenset(requires),
        requires_tags=frozenset(requires_tags),
        requires_forward_tags=frozenset(requires_forward_tags),
        provides=frozenset(provides),
    )

    def declare(fn: P) -> P:
        unknown = sorted(contract.requires - _FIELDS)
        if unknown:
            raise TypeError(f"pass {fn.__name__!r} requires {unknown}, which PassContext has no field for")
        wrong = sorted(contract.graphs - {JOINT, FORWARD, BACKWARD})
        if wrong:
            raise TypeError(f"pass {fn.__name__!r} rewrites {wrong}: a pass rewrites {JOINT}, {FORWARD} or {BACKWARD}")
        setattr(fn, _CONTRACT, contract)
        return fn

    return declare


def contract_of(pass_fn: Callable[..., Any]) -> Contract | None:
    """The contract `graph_pass` declared for a pass (None: an undeclared function)."""
    return getattr(pass_fn, _CONTRACT, None)


def as_declared(ctx: PassContext, pass_fn: Callable[..., Any]) -> PassContext:
    """`ctx` as `pass_fn` may read it (`run_passes` hands it this): where the pass declares a contract, reading a
    field it does not require (but `stage`) raises an AttributeError naming the pass and the field, so that what a
    pass requires is what it reads."""
    contract = contract_of(pass_fn)
    if contract is None:
        return ctx
    return cast(PassContext, _Declared(ctx, contract.requires | {"stage"}, _name(pass_fn)))


class _Declared:
    """A PassContext's view for one pass (`as_declared`)."""

    __slots__ = ("_ctx", "_readable", "_pass")

    def __init__(self, ctx: PassContext, readable: frozenset[str], pass_name: str):
        self._ctx, self._readable, self._pass = ctx, readable, pass_name

    def __getattr__(self, field: str) -> Any:  # (only for what the slots are not)
        if field in _FIELDS and field not in self._readable:
            raise AttributeError(
                f"pass {self._pass!r} reads ctx.{field}, which it does not require: add it to its graph_pass's "
                "requires (passes/contract.py)"
            )
        return getattr(self._ctx, field)


class PipelineError(Exception):
    """A pipeline whose order or contexts do not meet its passes' contracts (`check_order`)."""


def check_order(
    passes: Sequence[Pass], *, runs_on: Sequence[tuple[str, str]], after: Sequence[Pass] = ()
) -> tuple[Pass, ...]:
    """`passes` as a pipeline, checked against their contracts. `runs_on`: (graph, context) in the order the
    pipeline rewrites them (`CARRIED` names the contexts); `after`: the pipeline run before it on the joint graph,
    whose tags the partitioned graphs keep. On each graph, every pass that rewrites it must find the context fields
    it requires in that graph's context, and the tags it requires provided by a pass before it on that graph (on
    the forward graph, for `requires_forward_tags`). Raises PipelineError naming the pass, the field or tag, and
    the passes before it; returns the passes."""
    names = [_name(p) for p in passes]
    contracts = [_declared(p) for p in passes]
    joint: set[str] = set().union(*(_declared(p).provides for p in after))
    tags: dict[str, set[str]] = {}
    for graph, context in runs_on:
        tags[graph] = set(joint) if graph != JOINT else set()
        for i, (name, contract) in enumerate(zip(names, contracts)):
            if graph not in contract.graphs:
                continue
            before = names[:i] or "no passes"
            missing = sorted(contract.requires - CARRIED[context])
            if missing:
                fields = f"field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
                raise PipelineError(
                    f"pass {name!r} requires the context {fields} on the {graph} graph, which the {context} context "
                    f"does not carry (CARRIED in passes/contract.py; passes before it: {before})"
                )
            forward = tags.get(FORWARD, set())
            for tag, found, where in [
                *((t, tags[graph], graph) for t in sorted(contract.requires_tags)),
                *((t, forward, FORWARD) for t in sorted(contract.requires_forward_tags)),
            ]:
                if tag not in found:
                    raise PipelineError(
                        f"pass {name!r} requires the tag {tag!r} on the {where} graph, which no pass before it "
                        f"provides (passes before it: {before})"
                    )
            tags[graph] |= contract.provides
    return tuple(passes)


def _declared(pass_fn: Callable[..., Any]) -> Contract:
    contract = contract_of(pass_fn)
    if contract is None:
        raise PipelineError(
            f"pass {_name(pass_fn)!r} declares no contract: decorate it with graph_pass (passes/contract.py)"
        )
    return contract


def _name(pass_fn: Callable[..., Any]) -> str:
    return getattr(pass_fn, "__name__", repr(pass_fn))
