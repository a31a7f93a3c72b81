"""Plan for a machine you do not have: the plan, step time and tokens/s the planner predicts for a profile taken
here, on another world size, GPU memory, host memory and hardware rates, and the largest model of that kind that
fits there.

    backend = protrain_fx.ProTrainBackend({"executor": "eager"}, explain=True)  # profile and plan, nothing moved
    torch.compile(model, backend=backend)(**batch).loss.backward()             # one profiled iteration
    found = protrain_fx.what_if(
        backend,                            # or a dump's graph folder: "dumps/rank0/graph0"
        world_size=8,
        gpu_memory_bytes=80 * 2**30,
        host_memory_bytes=1000 * 2**30,     # the node's, shared by its ranks
        hardware="h100_node.json",          # a hardware profile measured there (its cache file), or field overrides
        tokens=batch["input_ids"].numel(),  # one rank's tokens per step, for tokens/s
    )
    found.plan, found.tokens_per_s          # the plan and its tokens/s; found.largest_n_block: the largest model

The profile's blocks are alike, so a profile of a few blocks stands for a model of more (`n_block`): a middle
block's profiled nodes, parameters and memory changes repeat (the first and last blocks, which may differ, stay
once; for fewer blocks, middle ones are left out), and the chunk layout is searched again for that model. The chunk
layout is also searched again for the world size (each chunk pads to a multiple of the ranks). What the ranks of a
node share is priced as shared: each rank plans with its share of the node's host memory, less what its process
keeps for the rest of training (`profiler/hardware.py: host_share`); the hardware profile given should be one
measured with every rank of such a node at once (as `hardware_profile` measures under torchrun), its collectives
at that world size.

Planned as the backend plans (backend/planning.py `_search_profile`): `planner/inputs.py: cost_model`, the swap
interval settled from it, and `planner/search.py: plan_graph`; so the plan for N ranks from a 1-rank profile is the
plan an N-rank run makes on the same figures. What the backend reads off the graphs for a layout (the chunk buffers
each n_persist needs, the chunks gathered again) is carried over to the new layout, chunk by first parameter.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from protrain_fx.debug.from_dump import read_dump
from protrain_fx.planner.chunking import ChunkLayout, ParamInfo, layout_at, search_layout
from protrain_fx.planner.cost import CostModel, swap_interval
from protrain_fx.planner.inputs import PlanningInputs, cost_model, settled
from protrain_fx.planner.plan import Plan, master_bytes
from protrain_fx.planner.search import NoPlanFits, plan_fits, plan_graph, states_alone
from protrain_fx.profiler.hardware import HOST_RESERVE_BYTES, HardwareProfile, compile_workers_bytes, host_share
from protrain_fx.profiler.profile import GraphProfile, NodeProfile

log = logging.getLogger(__name__)

MAX_BLOCKS = 1024  # the largest model is searched for up to this many blocks
COPY = "__copy"  # a repeated block's nodes and parameters are named as the original's, this and the copy's number


@dataclasses.dataclass(frozen=True)
class WhatIf:
    """What `what_if` predicts: the plan of the model at `n_block` blocks on the machine (None where none fits:
    `no_fit` says why), its step time and all ranks' tokens/s, and the largest model of its kind that fits there
    (`largest_*`; None where not searched; `largest_n_block` 0: not even one block)."""

    world_size: int
    n_block: int
    n_params: int  # parameters the plan lays out in chunks (those the profiled graph trains)
    plan: Plan | None
    step_s: float | None
    tokens_per_s: float | None  # None: `tokens` not given
    no_fit: str | None = None
    largest_n_block: int | None = None
    largest_n_params: int | None = None
    largest_plan: Plan | None = None
    largest_tokens_per_s: float | None = None

    def __str__(self) -> str:
        head = f"{self.world_size} rank(s), {self.n_block} blocks, {self.n_params / 1e9:.3f}B parameters: "
        if self.plan is None:
            lines = [head + "no plan fits", str(self.no_fit)]
        else:
            lines = [head + f"{self.step_s * 1e3:.1f} ms per step{_rate(self.tokens_per_s)}"]
        if self.largest_n_block is not None:
            bounded = f" (not searched past {MAX_BLOCKS} blocks)" if self.largest_n_block >= MAX_BLOCKS else ""
            lines.append(
                f"largest that fits: {self.largest_n_block} blocks, {(self.largest_n_params or 0) / 1e9:.3f}B "
                f"parameters{_rate(self.largest_tokens_per_s)}{bounded}"
            )
        return "\n".join([*lines, *([str(self.plan)] if self.plan is not None else [])])


def _rate(tokens_per_s: float | None) -> str:
    return f", {tokens_per_s:,.0f} tokens/s" if tokens_per_s is not None else ""


def what_if(
    source: Any,
    *,
    world_size: int = 1,
    gpu_memory_bytes: int | None,
    host_memory_bytes: int | None = None,
    ranks_per_node: int | None = None,
    hardware: HardwareProfile | Mapping[str, Any] | str | Path | None = None,
    n_block: int | None = None,
    tokens: int | None = None,
    forced: Mapping[str, Any] | None = None,
    host_reserve_bytes: int | None = None,
    largest: bool = True,
) -> WhatIf:
    """The plan, predicted step time and tokens/s of the profiled model on `world_size` ranks with
    `gpu_memory_bytes` of GPU each and `host_memory_bytes` of host per node (None: not budgeted), shared by the
    node's `ranks_per_node` ranks (default: all on one node), each keeping `host_reserve_bytes` of it (default:
    `HOST_RESERVE_BYTES` and inductor's compile workers', as `host_capacity` keeps) for the rest of its training;
    and, with `largest`, the largest model of its kind (the most blocks, up to MAX_BLOCKS) that fits there.

    `source`: a profile taken here: a `ProTrainBackend` that compiled the model and ran it once (its graph of the
    most parameters; `ProTrainBackend(options, explain=True)` profiles and plans without moving anything), one of
    its `GraphRecord`s, a dump's graph folder (`rank<r>/graph<k>` of `options={"dump_dir": ...}`), or a
    (GraphProfile, PlanningInputs) pair. `hardware`: the target's `HardwareProfile`, the path of one's JSON (a file
    of the hardware cache, `$PROTRAIN_CACHE_DIR/hardware/`), or a dict of fields replacing the profile's own
    (`{"host_adam_s_per_param": 2e-10}`); default: the profile's own. `n_block`: the model at that many blocks
    (default: as profiled). `tokens`: one rank's tokens per step as profiled (batch times sequence), for tokens/s.
    `forced`: plan fields to force (default: those the profile was planned with).

        found = what_if("dumps/rank0/graph0", world_size=4, gpu_memory_bytes=80 * 2**30,
                        host_memory_bytes=500 * 2**30, hardware={"collectives": measured_on_4_ranks},
                        tokens=8 * 2048)
        found.plan.n_persist, found.tokens_per_s, found.largest_n_block

    Where no plan fits the model at `n_block`, the result's plan is None and `no_fit` says what the machine
    lacks (NoPlanFits is raised instead where `largest` is False)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"what_if(world_size=...) must be a positive int, got {world_size!r}")
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    if not isinstance(ranks_per_node, int) or not 1 <= ranks_per_node <= world_size:
        raise ValueError(f"what_if(ranks_per_node=...) must be an int from 1 to world_size, got {ranks_per_node!r}")
    if n_block is not None and (not isinstance(n_block, int) or n_block < 1):
        raise ValueError(f"what_if(n_block=...) must be a positive int, got {n_block!r}")
    profile, inputs = _source(source)
    if (n_block is not None or largest) and inputs.n_block == 0:
        if n_block is not None:
            raise ValueError("the profiled graph has no transformer blocks to repeat: leave what_if's n_block out")
        largest = False
    machine = Machine(
        world_size=world_size,
        gpu_bytes=gpu_memory_bytes,
        host_bytes=_host_per_rank(host_memory_bytes, ranks_per_node, host_reserve_bytes),
        hardware=_hardware(inputs.hardware, hardware, world_size),
        forced=dict(inputs.forced if forced is None else forced),
        tokens=tokens,
        ranks_per_node=ranks_per_node,
    )
    blocks = inputs.n_block if n_block is None else n_block
    try:
        result = machine.what_if(profile, inputs, blocks)
    except NoPlanFits as error:
        if not largest:
            raise
        result = WhatIf(world_size, blocks, 0, None, None, None, no_fit=str(error))
    if largest:
        top = machine.largest(profile, inputs, start=blocks, known=result if result.plan is not None else None)
        result = dataclasses.replace(
            result,
            largest_n_block=top.n_block,
            largest_n_params=top.n_params,
            largest_plan=top.plan,
            largest_tokens_per_s=top.tokens_per_s,
        )
    return result


@dataclasses.dataclass(frozen=True)
class Machine:
    """The machine planned for: its world size, each rank's GPU and host bytes (None: not budgeted), its hardware
    profile, the plan fields forced, one rank's tokens per step (None: not known), and the ranks of a node, which
    share its host."""

    world_size: int
    gpu_bytes: int | None
    host_bytes: int | None
    hardware: HardwareProfile
    forced: dict[str, Any]
    tokens: int | None = None
    ranks_per_node: int = 1

    def what_if(self, profile: GraphProfile, inputs: PlanningInputs, n_block: int) -> WhatIf:
        """The plan of the profiled model at `n_block` blocks on this machine, as the backend plans it
        (backend/planning.py `_search_profile`). Raises NoPlanFits."""
        costs, layout = self._costs(profile, inputs, n_block)
        plan = plan_graph(
            costs, self.forced, layout, self.gpu_bytes, self.host_bytes, machine_ranks=self.ranks_per_node
        )
        n_params = sum(s.numel for s in layout.slots) if layout is not None else 0
        step_s = plan.predicted_step_s
        rate = self.world_size * self.tokens / step_s if self.tokens is not None and step_s else None
        return WhatIf(self.world_size, n_block, n_params, plan, step_s, rate)

    def _costs(self, profile: GraphProfile, inputs: PlanningInputs, n_block: int):
        """The cost model the backend would search for the model at `n_block` blocks, and its chunk layout."""
        profile, inputs = scaled(profile, inputs, n_block, self.world_size, self.forced.get("chunk_bytes"))
        inputs = dataclasses.replace(inputs, hardware=self.hardware, forced=self.forced)
        costs = cost_model(profile, inputs)
        layout = inputs.layout
        shared = layout is not None and self.forced.get("n_persist", 0) < layout.n_chunk  # uploads in the forward
        interval = self.forced.get("swap_interval") or swap_interval(
            costs.block_saved, costs.block_fwd_s, self.hardware, uploads_share_link=shared
        )
        return settled(costs, dataclasses.replace(inputs, swap_interval=interval)), layout

    def largest(self, profile: GraphProfile, inputs: PlanningInputs, *, start: int, known: WhatIf | None) -> WhatIf:
        """The plan of the model of the most blocks (up to MAX_BLOCKS) that fits this machine (`fits`), found by
        doubling from `start` blocks while models fit, then bisecting (fewer blocks fit where more do: every
        block adds memory); `known`: the plan at `start`. Its plan is None where not even one block fits."""
        tried = {start: known is not None and self._fits(known.plan)}

        def fits(blocks: int) -> bool:
            if blocks not in tried:
                tried[blocks] = self.fits(profile, inputs, blocks)
            return tried[blocks]

        lo, hi = 0, None  # the most blocks known to fit (0: none), the fewest known not to (None: none)
        if fits(start):
            lo = start
            while lo < MAX_BLOCKS:
                probe = min(2 * lo, MAX_BLOCKS)
                if not fits(probe):
                    hi = probe
                    break
                lo = probe
        else:
            hi = start
            while hi > 1 and not fits(hi // 2):
                hi //= 2
            lo = hi // 2
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        if lo == 0:
            return WhatIf(self.world_size, 0, 0, None, None, None)
        found = known if lo == start else self.what_if(profile, inputs, lo)
        log.info("largest model that fits: %d blocks, %d parameters", lo, found.n_params)
        return found

    def fits(self, profile: GraphProfile, inputs: PlanningInputs, n_block: int) -> bool:
        """Whether a plan of the model at `n_block` blocks fits this machine, searched among those that drop every
        block's activations (swapped or checkpointed, fewest swapped first: swapping takes host memory; no
        selective block, which keeps more than a checkpointed one): no plan that keeps some fits where none of
        these does, and each such search is one over the chunk fields only, and times none (`plan_fits`). Block
        modes the user forced are searched as forced."""
        try:
            self._states_fit(inputs, n_block)  # (at once where the chunks alone do not fit)
        except NoPlanFits:
            return False
        costs, layout = self._costs(profile, inputs, n_block)
        if {"n_swap", "n_checkpoint", "n_selective", "block_modes"} & self.forced.keys():
            tries = [self.forced]
        else:
            swapped = range(n_block // costs.swap_interval + 1)
            tries = [{**self.forced, "n_swap": k, "n_checkpoint": n_block - k, "n_selective": 0} for k in swapped]
        return any(plan_fits(costs, forced, layout, self.gpu_bytes, self.host_bytes) for forced in tries)

    def _fits(self, plan: Plan) -> bool:
        """Whether `plan` fits the GPU: a searched one does; one of only forced fields is kept over capacity, as
        the backend keeps it, but fits no better for that."""
        return self.gpu_bytes is None or plan.predicted_reserved_bytes <= self.gpu_bytes

    def _states_fit(self, inputs: PlanningInputs, n_block: int) -> None:
        """NoPlanFits where the model's chunks at `n_block` blocks fit this machine in no placement even with no
        activations (`planner/search.py: states_alone`): what a search finds last, found in a moment."""
        layout = _laid_out(inputs, Blocks.of(inputs.n_block, n_block), self.world_size, self.forced.get("chunk_bytes"))
        if layout.layout is not None:
            states = CostModel.of_states(layout.layout, master_bytes(self.forced))
            states_alone(states, self.gpu_bytes, self.host_bytes)


def _source(source: Any) -> tuple[GraphProfile, PlanningInputs]:
    """The profile and planner inputs of `source` (see `what_if`)."""
    if isinstance(source, tuple) and len(source) == 2:
        profile, inputs = source
        if isinstance(profile, GraphProfile) and isinstance(inputs, PlanningInputs):
            return profile, inputs
    if isinstance(source, (str, Path)):
        return read_dump(Path(source).expanduser())
    records = getattr(source, "graphs", None)
    if isinstance(records, list):  # a ProTrainBackend: its graph of the most parameters that was planned
        planned = [r for r in records if r.profile is not None and r.planning is not None and r.param_map]
        if not planned:
            raise ValueError(
                "what_if(): the backend has no profiled and planned graph with parameters: run the compiled model "
                "once (forward and backward) first; where its plans came from the plan cache, turn the cache off "
                "($PROTRAIN_PLAN_CACHE=off) or pass a dump's graph folder"
            )
        source = max(reversed(planned), key=lambda r: len(r.param_map))
    profile, inputs = getattr(source, "profile", None), getattr(source, "planning", None)
    if isinstance(profile, GraphProfile) and isinstance(inputs, PlanningInputs):
        return profile, inputs
    raise TypeError(
        "what_if() takes a ProTrainBackend that compiled and ran the model, one of its GraphRecords, a dump's "
        f"graph folder (rank<r>/graph<k>) or a (GraphProfile, PlanningInputs) pair, got {type(source).__name__}"
    )


def _host_per_rank(host_memory_bytes: int | None, ranks: int, reserve: int | None) -> int | None:
    if host_memory_bytes is None:
        return None
    reserve = HOST_RESERVE_BYTES + compile_workers_bytes() if reserve is None else reserve
    return host_share(host_memory_bytes, ranks, reserve)


def _hardware(own: HardwareProfile, given: Any, world_size: int) -> HardwareProfile:
    """The target's hardware profile (see `what_if`)."""
    if isinstance(given, (str, Path)):
        given = HardwareProfile.from_json(json.loads(Path(given).expanduser().read_text()))
    if given is None:
        hardware = own
    elif isinstance(given, HardwareProfile):
        hardware = given
    elif isinstance(given, Mapping):
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(HardwareProfile)})
        if unknown:
            raise ValueError(f"what_if(hardware=...) has no fields {unknown}: name fields of HardwareProfile")
        hardware = HardwareProfile.from_json({**own.to_json(), **given})
    else:
        raise TypeError(
            "what_if(hardware=...) takes a HardwareProfile, the path of one's JSON or a dict of its fields, got "
            f"{type(given).__name__}"
        )
    if world_size > 1 and not hardware.collectives:
        log.warning(
            "what_if for %d ranks on a hardware profile without collectives: the chunks' all-gathers and "
            "reduce-scatters are priced at nothing; pass one measured on %d ranks",
            world_size,
            world_size,
        )
    return hardware


# ----- a profile of a few blocks standing for more --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The profiled block each block of the model is like (`order`, as `block_order` gives it)."""

    n_profiled: int
    order: tuple[int, ...]

    @classmethod
    def of(cls, n_profiled: int, n_block: int) -> Blocks:
        """A middle block repeated (the first and the last kept once), or for fewer blocks middle ones left out."""
        t = n_profiled // 2 if n_profiled >= 3 else n_profiled - 1
        if n_block >= n_profiled:
            return cls(n_profiled, (*range(t + 1), *[t] * (n_block - n_profiled), *range(t + 1, n_profiled)))
        if n_block == 1:
            return cls(n_profiled, (0,))
        drop = n_profiled - n_block
        first = max(1, min(t, n_profiled - 1 - drop))
        return cls(n_profiled, (*range(first), *range(first + drop, n_profiled)))

    @property
    def n_block(self) -> int:
        return len(self.order)

    def copy(self, new: int) -> int:
        """Which copy of its profiled block block `new` is (0: the first)."""
        return self.order[:new].count(self.order[new])

    def relative(self, block: int | None, o: int, new: int) -> int | None:
        """The block of a node in profiled block `o`'s span, laid out as block `new`, where the profile says
        `block`: as far from `new` as from `o` (a block's own, the next block's), but the last block for a block
        two or more past `o` that is the last profiled one (what every block reads, an attention mask)."""
        if block is None:
            return None
        if block == self.n_profiled - 1 and block - o >= 2:
            return self.n_block - 1
        return min(max(new + block - o, 0), self.n_block - 1)

    def renumber(self, block: int | None, *, last: bool = False) -> int | None:
        """A profiled block's index in the model: its first copy's (`last`: its last copy's), or the nearest kept
        block's before it where it was left out; past the profiled blocks, as far past the model's."""
        if block is None:
            return None
        if block >= self.n_profiled:
            return block - self.n_profiled + self.n_block
        kept = [o for o in set(self.order) if o <= block]
        if not kept:
            return 0
        o = max(kept)
        return self.n_block - 1 - self.order[::-1].index(o) if last else self.order.index(o)


def scaled(
    profile: GraphProfile, inputs: PlanningInputs, n_block: int, world_size: int, chunk_bytes: int | None = None
) -> tuple[GraphProfile, PlanningInputs]:
    """The profile and planner inputs of the model at `n_block` blocks (`Blocks.of`), its chunks laid out for
    `world_size` ranks as the backend lays a model out (`runtime/adopt.py: model_layout`); unchanged at the
    profiled count where that gives the profiled layout."""
    blocks = Blocks.of(inputs.n_block, n_block) if inputs.n_block else Blocks(0, ())
    if n_block != inputs.n_block:
        profile, renamed = _scaled_profile(profile, blocks)
        grads = inputs.grad_outputs | {new for new, old in renamed.items() if old in inputs.grad_outputs}
        inputs = dataclasses.replace(inputs, grad_outputs=frozenset(grads))
    return profile, _laid_out(inputs, blocks, world_size, chunk_bytes)


def _places(nodes: Sequence[NodeProfile], n_profiled: int, graph: str) -> list[int]:
    """Each node's span: in the forward the highest block reached so far, -1 before the blocks and n_profiled
    after the last block's last node; in the backward the highest block still to come, n_profiled before the
    last block's first node and -1 once none is to come."""
    tagged = [i for i, n in enumerate(nodes) if n.block == n_profiled - 1]
    places, highest = [0] * len(nodes), -1
    steps = range(len(nodes)) if graph == "forward" else reversed(range(len(nodes)))
    for i in steps:
        highest = max(highest, nodes[i].block if nodes[i].block is not None else -1)
        if graph == "forward":
            places[i] = n_profiled if tagged and i > tagged[-1] else highest
        else:
            places[i] = n_profiled if tagged and i < tagged[0] else highest
    return places


def _scaled_profile(profile: GraphProfile, blocks: Blocks) -> tuple[GraphProfile, dict[str, str]]:
    """The profile with its blocks' spans of nodes laid out as `blocks` says, each node's allocated bytes moved by
    what the spans before it leave held more or less than the profiled ones; and each copy's name -> its
    original's. Forward and backward alike: a span leaves held what it allocated and did not free (its
    `allocated_before` after it less before it)."""
    n = blocks.n_profiled
    out: list[NodeProfile] = []
    renamed: dict[str, str] = {}
    offset = 0  # what the model's forward leaves held more than the profiled one's, at the backward's start
    for graph in ("forward", "backward"):
        nodes = [node for node in profile.nodes if node.graph == graph]
        places = _places(nodes, n, graph)
        spans: dict[int, list[int]] = {}
        for i, place in enumerate(places):
            spans.setdefault(place, []).append(i)
        held = {o: _held(nodes, spans.get(o, [])) for o in range(n)}
        first, last = (-1, n) if graph == "forward" else (n, -1)
        sequence = list(enumerate(blocks.order))
        profiled = list(range(n))
        if graph == "backward":
            sequence, profiled = sequence[::-1], profiled[::-1]

        out += [_moved(nodes[i], offset, blocks) for i in spans.get(first, [])]
        laid = 0  # what the spans laid out so far hold, less what the profiled spans before this one held
        for new, o in sequence:
            before = laid - sum(held[b] for b in profiled[: profiled.index(o)])
            copy = blocks.copy(new)
            for i in spans.get(o, []):
                node = nodes[i]
                name = node.name if copy == 0 else f"{node.name}{COPY}{copy}"
                if copy:
                    renamed[name] = node.name
                out.append(_moved(node, offset + before, blocks, (o, new), name))
            laid += held[o]
        offset += laid - sum(held.values())
        out += [_moved(nodes[i], offset, blocks) for i in spans.get(last, [])]
    return _totals(profile, out, blocks), renamed


def _moved(
    node: NodeProfile, by: int, blocks: Blocks, span: tuple[int, int] | None = None, name: str = ""
) -> NodeProfile:
    """`node` with `by` more bytes allocated before it, named `name`: of profiled block o's span laid out as block
    new (`span`: (o, new)), its blocks as far from new as from o (`Blocks.relative`); outside the blocks' spans, as
    its block's first copy."""
    if span is not None:
        block, needed = (blocks.relative(b, *span) for b in (node.block, node.needed_from_block))
    elif node.block is not None:
        block = blocks.renumber(node.block)
        needed = blocks.relative(node.needed_from_block, node.block, block)
    else:
        block, needed = None, blocks.renumber(node.needed_from_block, last=True)
    return dataclasses.replace(
        node, name=name or node.name, allocated_before=node.allocated_before + by, block=block, needed_from_block=needed
    )


def _held(nodes: Sequence[NodeProfile], span: Sequence[int]) -> int:
    """Bytes a span of `nodes` (their indices) allocated and still held after it."""
    if not span:
        return 0
    after, end = span[-1] + 1, nodes[span[-1]]
    held_after = nodes[after].allocated_before if after < len(nodes) else end.allocated_before + end.output_bytes
    return held_after - nodes[span[0]].allocated_before


def _totals(profile: GraphProfile, nodes: list[NodeProfile], blocks: Blocks) -> GraphProfile:
    """`profile` with `nodes` in place of its own, and the totals and block records that follow from them (the
    allocator's reserved bytes grown with the peak: the same fragmentation)."""

    def peak(of: Sequence[NodeProfile]) -> int:
        return max((n.allocated_before + max(n.intra_delta_bytes, n.inter_delta_bytes, 0) for n in of), default=0)

    grown = peak(nodes) - peak(profile.nodes)
    ratio = (profile.peak_bytes + grown) / profile.peak_bytes if profile.peak_bytes else 1.0
    per_block = {b.block: b for b in profile.blocks}
    records = [dataclasses.replace(per_block[o], block=new) for new, o in enumerate(blocks.order) if o in per_block]
    return dataclasses.replace(
        profile,
        nodes=nodes,
        blocks=records,
        forward_s=sum(n.latency_s for n in nodes if n.graph == "forward"),
        backward_s=sum(n.latency_s for n in nodes if n.graph == "backward"),
        saved_bytes=profile.saved_bytes
        + sum(b.saved_bytes for b in records)
        - sum(b.saved_bytes for b in profile.blocks),
        peak_bytes=profile.peak_bytes + grown,
        measured_peak_bytes=int(profile.measured_peak_bytes * ratio),
        reserved_bytes=int(profile.reserved_bytes * ratio),
    )


def _laid_out(inputs: PlanningInputs, blocks: Blocks, world_size: int, chunk_bytes: int | None) -> PlanningInputs:
    """The planner inputs with each block's parameters laid out as `blocks` says (a copy's named as its nodes
    are), in chunks searched again for `world_size` ranks; what the backend reads off the graphs for a layout
    carried over from the profiled one (`_carried`)."""
    if inputs.layout is None:
        return dataclasses.replace(inputs, n_block=blocks.n_block)
    old = inputs.layout
    infos = param_infos(old, inputs.block_of_param, inputs.regathers)
    if blocks.n_block != inputs.n_block:
        infos = _repeated(infos, blocks)
    layout = search_layout(infos, old.element_size, world_size, chunk_bytes=chunk_bytes)
    if layout == old:
        return inputs
    return _carried(inputs, layout, infos, blocks)


def _repeated(infos: list[ParamInfo], blocks: Blocks) -> list[ParamInfo]:
    """The parameters of the model of `blocks`: each block's as its profiled block's (copies renamed); those
    outside the blocks once, where they were (after the last copy of the block they followed)."""
    n = blocks.n_profiled
    inside: dict[int, list[ParamInfo]] = {}
    after: dict[int, list[ParamInfo]] = {}  # outside the blocks, after block b's (-1: before the blocks)
    behind = -1
    for info in infos:
        if info.block is not None and info.block < n:
            inside.setdefault(info.block, []).append(info)
            behind = info.block
        else:
            after.setdefault(behind, []).append(info)
    anchor = {b: blocks.renumber(b, last=True) if b >= 0 else -1 for b in after}
    laid = list(after.get(-1, []))
    for new, o in enumerate(blocks.order):
        copy = blocks.copy(new)
        laid += [
            dataclasses.replace(p, name=p.name if copy == 0 else f"{p.name}{COPY}{copy}", block=new)
            for p in inside.get(o, [])
        ]
        laid += [p for b, params in after.items() if b >= 0 and anchor[b] == new for p in params]
    return laid


def _carried(inputs: PlanningInputs, layout: ChunkLayout, infos: list[ParamInfo], blocks: Blocks) -> PlanningInputs:
    """`inputs` on `layout` (of `infos`), with what the backend reads off the graphs carried over from the
    profiled layout, matched by parameter (a copy's as its original's): the chunks gathered again (in or before the
    same block), and the chunk buffers each n_persist needs (those of the profiled chunk holding the new chunk's
    first parameter, the first offloaded one)."""
    old = inputs.layout
    old_chunk = {s.name: s.chunk for s in old.slots}
    new_chunk = {s.name: s.chunk for s in layout.slots}
    alone = {s.chunk: s.name for s in old.slots}  # (a chunk gathered again holds one parameter)
    regathers = tuple(
        sorted({(new_chunk[alone[c]], blocks.renumber(b)) for c, b in inputs.regathers if alone.get(c) in new_chunk})
    )
    least = inputs.least_buffers
    if least:
        first: dict[int, str] = {}
        for s in layout.slots:
            first.setdefault(s.chunk, s.name.split(COPY)[0])
        least = (*(least[old_chunk[first[c]]] for c in range(layout.n_chunk)), least[-1])
    return dataclasses.replace(
        inputs,
        n_block=blocks.n_block,
        layout=layout,
        block_of_param=tuple(p.block for p in infos),
        regathers=regathers,
        least_buffers=least,
    )


def param_infos(
    layout: ChunkLayout, block_of_param: Sequence[int | None], regathers: Sequence[tuple[int, int]]
) -> list[ParamInfo]:
    """The parameters a layout was searched for, read back from it: each slot's block (`block_of_param`), alone in
    its chunk where the forward gathers that chunk again (`regathers`), and another optimizer's group from each
    slot where the layout starts a chunk that the same group would not have. Laid out again at the layout's chunk
    size, they give the layout."""
    alone_chunks = {c for c, _ in regathers}
    blocks = list(block_of_param) + [None] * (len(layout.slots) - len(block_of_param))
    groups = [0] * len(layout.slots)

    def infos() -> list[ParamInfo]:
        return [
            ParamInfo(s.name, s.numel, b, s.chunk in alone_chunks, g) for s, b, g in zip(layout.slots, blocks, groups)
        ]

    for _ in range(layout.n_chunk + 1):
        again = layout_at(infos(), layout.chunk_elems, layout.element_size, layout.world_size)
        if again == layout:
            return infos()
        split = next(
            (
                i
                for i, (s, t) in enumerate(zip(layout.slots, again.slots))
                if (s.chunk, s.offset) != (t.chunk, t.offset)
            ),
            None,
        )
        if split is None or split == 0 or layout.slots[split].offset != 0:
            break
        groups[split:] = [g + 1 for g in groups[split:]]
    raise ValueError(
        "what_if(): the profiled chunk layout could not be read back (its parameters laid out again differ); "
        "profile the model again with this version of protrain_fx"
    )
