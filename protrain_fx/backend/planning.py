"""The plan stage of one graph (backend/partition.py calls `plan`): the planner's inputs built from the graph, its
model and the machine (`PlanningInputs`, planner/inputs.py), the search (planner/search.py), and the model's chunks
built or placed for the plan (runtime/adopt.py). A re-plan out of GPU memory reuses the graph's profile and comes
here again with a lower capacity. The search's result, and the closed loop's decision, may come from the plan cache
of an earlier run (backend/cache.py)."""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from protrain_fx.backend.cache import resumed, searched
from protrain_fx.backend.phases import phase_done, plan_chosen
from protrain_fx.backend.record import PLANS_ATTR, GraphCompile, GraphRecord
from protrain_fx.backend.sizes import guard_within
from protrain_fx.capture import FrameRoots, ParamEntry
from protrain_fx.distributed import least_on_every_rank
from protrain_fx.host_queue import machine_ranks
from protrain_fx.passes.chunks import buffers_needed
from protrain_fx.planner.calibrate import calibrated
from protrain_fx.planner.cost import Candidate, CostModel, swap_interval
from protrain_fx.planner.inputs import PlanningInputs, cost_model, settled
from protrain_fx.planner.plan import (
    ACTIVATION_FIELDS,
    CHUNK_FIELDS,
    OUTPUT_FIELDS,
    Plan,
    master_bytes,
    with_default_master,
)
from protrain_fx.planner.search import NoPlanFits, plan_graph, states_alone
from protrain_fx.profiler.hardware import compile_workers_bytes, device_capacity, hardware_profile, host_capacity
from protrain_fx.profiler.on_demand import storage_key
from protrain_fx.runtime.adopt import (
    build_manager,
    model_layout,
    place_chunks,
    plan_fields_of,
    updates_wait,
    wants_chunks,
)
from protrain_fx.runtime.oom import Replanning, device_state, first_line

log = logging.getLogger(__name__)

SHAPES_ATTR = "_protrain_input_shapes"  # on the model: graph's parameter count -> input shapes it was planned for


def plan(c: GraphCompile, roots: FrameRoots, manager, graphs: tuple[fx.GraphModule, fx.GraphModule]):
    """The plan (planner/), and the model's chunks where it gets them: built for the plan at the model's first
    graph, or a prepared model's placed by it. `graphs`: the forward and backward as first partitioned. Returns
    the model's chunk manager (None: no chunks)."""
    record, config, params = c.record, c.config, c.params
    if manager is None and (wants_chunks(params) or (c.explain and any(p.requires_grad for p in params))):
        layout = model_layout(roots, record, c.example_inputs, config.plan, every_trainable=c.explain)
        c.config = config = dataclasses.replace(config, plan=with_default_master(config.plan, layout))
        record.plan = resumed(c, _search_at_largest_sizes(c, config.plan, layout, graphs, roots.model, None))
        if not c.explain:
            manager = _build_chunks(c, roots.model, layout, graphs)
    else:
        # a graph without parameters (a loss after a graph break) has no chunk or block decisions to check
        unplanned = OUTPUT_FIELDS + CHUNK_FIELDS + (ACTIVATION_FIELDS if not record.block_map.families else ())
        forced = config.plan if params else {k: v for k, v in config.plan.items() if k not in unplanned}
        if manager is not None:
            forced = plan_fields_of(manager, forced)
        layout = manager.layout if manager else None
        if c.switching is not None:  # (placed for it: runtime/replan.py)
            record.plan, record.costs = c.switching
        else:
            record.plan = resumed(c, _search_at_largest_sizes(c, forced, layout, graphs, roots.model, manager))
        if manager is not None and manager.pending_plan is not None and params:
            place_chunks(manager, record.plan)
    log.info(
        "graph %d planned (%s):\n%s",
        record.index,
        ", ".join(f"{stage} {s:.2f} s" for stage, s in record.seconds.items()),
        record.plan,
    )
    if c.switching is None:  # (the closed loop's switch is logged as a warning, with both plans)
        searched_s = None if "plan" in record.from_cache else record.seconds.get("search")
        phase_done(record.index, "search", searched_s, record.cache)
        plan_chosen(record.index, record.plan, record.from_cache)
    record.model = weakref.ref(roots.model) if roots.model is not None else None
    record.manager = weakref.ref(manager) if manager is not None else None
    if manager is not None and params:  # (the latest plan of the model's graphs decides)
        manager.edits.n_clip_overlap = record.plan.n_clip_overlap
        manager.outside.note_read_by_graph(params, record.key)
    if roots.model is not None and params and not c.explain:
        _warn_if_reshaped(roots.model, record, c.example_inputs)
        entry = (len(params), record.plan, record.shapes, record.from_cache)
        roots.model.__dict__.setdefault(PLANS_ATTR, []).append(entry)
    return manager


def _build_chunks(c: GraphCompile, model: nn.Module, layout, graphs: tuple[fx.GraphModule, fx.GraphModule]):
    """The model's ChunkManager for the plan; out of memory, under on_oom="replan", searched again under a
    lower capacity and built again (runtime/oom.py)."""
    device, record = c.device, c.record
    replanning = c.guard.replanning if c.guard is not None else Replanning(c.config, device)
    while True:
        try:
            return build_manager(model, layout, record.plan)
        except torch.OutOfMemoryError as error:
            state, cause = device_state(device), first_line(error)
        if device.type == "cuda":  # what the partly built chunks had cached
            torch.cuda.empty_cache()
        if not replanning.lower(record.capacity):
            raise replanning.error("chunk building", record.index, record.plan, record.capacity, state, cause)
        c.config = replanning.config
        record.plan = _search_at_largest_sizes(c, c.config.plan, layout, graphs, model, None)


def _search_at_largest_sizes(
    c: GraphCompile, forced: dict[str, Any], layout, graphs: tuple[fx.GraphModule, fx.GraphModule], model, manager
) -> Plan:
    """`_search_profile`, for a graph with symbolic sizes at the largest sizes it will see (backend/sizes.py):
    its profile fitted at them, the widest bound a plan fits first, and the graph guarded on it."""
    record = c.record
    if record.fit is None:
        return _search_profile(c, forced, layout, graphs, model, manager)
    for largest, smaller_follows in record.sizes.bounds(c.config, model):
        record.profile = record.fit.at(largest)
        try:
            plan = _search_profile(c, forced, layout, graphs, model, manager)
        except NoPlanFits:
            if not smaller_follows:
                raise
            log.info("graph %d: no plan fits sizes up to %s; trying smaller", record.index, largest)
            continue
        record.shapes = record.sizes.shape_range(largest, [record.fit.a, record.fit.b])
        guard_within(c.example_inputs, largest)
        log.info("graph %d planned for symbolic sizes %s", record.index, record.shapes.describe())
        return plan
    raise AssertionError(f"graph {record.index}: no sizes to plan for")


def _search_profile(
    c: GraphCompile, forced: dict[str, Any], layout, graphs: tuple[fx.GraphModule, fx.GraphModule], model, manager
) -> Plan:
    """Search the fields the user did not force, with the cost models of this graph's profile (planner/cost.py).
    `graphs`: the forward and backward as first partitioned."""
    record, config, device, n_block = c.record, c.config, c.device, c.record.block_map.n_blocks
    bw = graphs[1]
    start = time.perf_counter()
    hardware = hardware_profile(device)
    record.seconds["hardware"] = time.perf_counter() - start
    shared = layout is not None and forced.get("n_persist", 0) < layout.n_chunk  # uploads during the forward
    output = next(n for n in bw.graph.nodes if n.op == "output")
    inputs = PlanningInputs(
        forced=dict(forced),
        n_block=n_block,
        layout=layout,
        block_of_param=tuple(record.block_map.block_of(s.name) for s in layout.slots) if layout else (),
        regathers=_regathers(record.param_map, layout, model) if layout else (),
        least_buffers=_least_buffers(graphs, record.param_map, layout, model) if layout else (),
        grad_outputs=frozenset(a.name for a in output.args[0] if isinstance(a, fx.Node)),
        fused=config.executor == "inductor",
        hardware=hardware,
    )
    costs = cost_model(record.profile, inputs)  # its swap interval, other bytes and waits settled below
    interval = forced.get("swap_interval") or swap_interval(
        costs.block_saved, costs.block_fwd_s, hardware, uploads_share_link=shared
    )
    # what the profile's baseline held besides activations and the chunk states the model counts itself
    held, waits = 0, False
    if layout is not None:
        graph_params = c.params
        waits = updates_wait(graph_params)
        if manager is not None:
            # the profile counts the offloaded parameters as held (profiler/on_demand.py); the persistent ones
            # are in their chunks: on the GPU among all the chunk states, on the CPU (whose tracker counts the
            # graph's inputs) the chunks the graph reads
            persistent = [p for p in graph_params if manager.holds(p) and manager.is_persistent(p)]
            held = _nbytes(p for p in graph_params if manager.holds(p) and not manager.is_persistent(p))
            if device.type == "cuda":
                held += costs.state_bytes(
                    Candidate(manager.n_persist, manager.n_buffer, n_device_shard=manager.n_device_shard)
                )
            else:
                held += sum({storage_key(p): p.untyped_storage().nbytes() for p in persistent}.values())
        elif device.type == "cuda":  # the allocator counts every parameter of the model on the device
            held = _nbytes(p for p in model.parameters() if p.device == device)
        else:  # the CPU tracker counts the graph's inputs
            held = _nbytes(graph_params)
    inputs = dataclasses.replace(
        inputs, swap_interval=interval, other_bytes=max(0, record.profile.baseline_bytes - held), updates_wait=waits
    )
    costs = settled(costs, inputs)
    loop = c.loop
    if loop is not None and loop.calibration is not None:  # (a later re-plan, out of memory, as training measured)
        costs = calibrated(costs, loop.calibration)
    record.costs = costs
    start = time.perf_counter()
    record.capacity, host, workers = _capacities(c, manager)
    forced_by = _forced_by(config.plan, manager)
    found = searched(
        c,
        (costs, sorted(forced.items()), layout, sorted(forced_by.items()), workers),  # (all the search reads)
        (record.capacity, host),
        lambda: plan_graph(
            costs,
            forced,
            layout,
            record.capacity,
            host,
            forced_by=forced_by,
            compile_workers_bytes=workers,
            machine_ranks=machine_ranks(),
        ),
    )
    record.seconds["search"] = time.perf_counter() - start
    record.planning = dataclasses.replace(inputs, capacity_bytes=record.capacity, host_bytes=host)
    return found


def check_states_fit(c: GraphCompile, manager) -> None:
    """Before a prepared model waiting for its plan is profiled (on demand: minutes for the largest models):
    NoPlanFits at once where no placement of its chunks fits the GPU and the host even with no activations."""
    if manager is None or manager.pending_plan is None:
        return
    forced = plan_fields_of(manager, c.config.plan)
    if "n_persist" in forced:  # (its chunks' host memory is the user's to give: not budgeted)
        return
    capacity, host, workers = _capacities(c, manager)  # (the search measures them again, after the profile)
    try:
        states_alone(CostModel.of_states(manager.layout, master_bytes(forced)), capacity, host)
    except NoPlanFits as error:  # (true whatever other fields are forced: it holds none of them)
        log.info("graph %d: no placement of the chunks fits even with no activations; not profiled", c.record.index)
        raise error.told(
            forced={}, forced_by={}, released=None, compile_workers_bytes=workers, machine_ranks=machine_ranks()
        ) from None


def _capacities(c: GraphCompile, manager) -> tuple[int | None, int | None, int]:
    """The GPU and host bytes this graph is planned under (the least of every rank's; None: not budgeted), and
    the host bytes kept out of them for inductor's compile workers, where the host capacity was measured."""
    config, device = c.config, c.device
    host = config.host_memory_bytes or host_capacity(device)
    workers = 0
    if host is not None and not config.host_memory_bytes:
        workers = compile_workers_bytes()
        if manager is not None:
            host += (
                manager.placement.pending_host_bytes
            )  # (the masters of chunks waiting for this plan, which it reuses)
    gpu, host = least_on_every_rank([config.gpu_memory_bytes or device_capacity(device), host], device)
    return gpu, host, workers


def _forced_by(options_plan: Mapping[str, Any], manager) -> dict[str, str]:
    """Where each forced plan field came from, for NoPlanFits to say: options['plan'], prepare's plan where the
    chunks wait for their plan, or the chunks already built (whose fields plan_fields_of forces)."""
    origin = {k: "options['plan']" for k in options_plan}
    if manager is None:
        return origin
    if manager.pending_plan is not None:
        return {**{k: "protrain_fx.prepare's plan" for k in manager.pending_plan}, **origin}
    built = "the chunks already built (by protrain_fx.prepare or an earlier graph)"
    return {
        **origin,
        **{k: built for k in ("n_persist", "n_device_shard", "n_buffer", "host_grad_slots", "device_grad_slots")},
    }


def _regathers(param_map: dict[str, ParamEntry], layout, model) -> tuple[tuple[int, int], ...]:
    """(chunk, block) for each time the forward gathers a chunk again, in or before that block (the last block + 1:
    after it), where a parameter of it is read again after other blocks ran (capture: `read_again_at`)."""
    chunks = _chunk_of_placeholders(param_map, layout, model)
    found = {(chunks[ph], block) for ph, entry in param_map.items() if ph in chunks for block in entry.read_again_at}
    return tuple(sorted(found))


def _least_buffers(graphs, param_map: dict[str, ParamEntry], layout, model) -> tuple[int, ...]:
    """For each n_persist, the fewest chunk buffers the forward and backward run with (passes/chunks.py)."""
    chunks = _chunk_of_placeholders(param_map, layout, model)
    per_graph = [buffers_needed(gm, chunks, layout.n_chunk) for gm in graphs]
    return tuple(max(needs) for needs in zip(*per_graph))


def _chunk_of_placeholders(param_map: dict[str, ParamEntry], layout, model) -> dict[str, int]:
    """Parameter placeholder name -> the chunk of its parameter in `layout`. Slots are matched by parameter: a tied
    parameter's name in the graph may be another of its names than the layout's."""
    ident = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)} if model is not None else {}
    chunk_of = {ident.get(s.name, s.name): s.chunk for s in layout.slots}
    found = {ph: chunk_of.get(ident.get(entry.name, entry.name)) for ph, entry in param_map.items()}
    return {ph: chunk for ph, chunk in found.items() if chunk is not None}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _input_shapes(example_inputs: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter)]


def _warn_if_reshaped(model: nn.Module, record: GraphRecord, example_inputs: Sequence[Any]) -> None:
    """A graph of this model compiled before for other input shapes (a new batch size or sequence length, under
    `dynamic=False`): each shape gets its own compile, profile and plan; say so once per new shape. Past Dynamo's
    `recompile_limit` compiles of one graph, Dynamo would run the model uncompiled, with no plan: the compile that
    reaches it stops with an error instead."""
    if record.fit is not None:  # (symbolic sizes: one plan for every shape up to its bound)
        return
    shapes = _input_shapes(example_inputs)
    seen = model.__dict__.setdefault(SHAPES_ATTR, {}).setdefault(len(record.param_map), [])
    if shapes in seen:
        return
    seen.append(shapes)
    limit = torch._dynamo.config.recompile_limit
    if len(seen) >= limit:
        raise ValueError(
            f"graph {record.index} of this model was compiled for {len(seen)} input shapes, Dynamo's "
            f"recompile_limit ({limit}), past which Dynamo runs the model uncompiled, with no memory plan. Compile "
            "with dynamic shapes (`torch.compile(model, backend='protrain')` or `dynamic=True`: one plan for every "
            "batch and sequence size), pad the inputs to fewer shapes, or raise torch._dynamo.config.recompile_limit"
        )
    if len(seen) > 1:
        log.warning(
            "graph %d recompiled for input shapes %s (planned before for %s): each input shape gets its own "
            "compile, profile and plan, which takes time; compile with dynamic shapes (the default, or "
            "dynamic=True) for one plan for every shape, or pad the inputs to one fixed shape",
            record.index,
            shapes,
            seen[-2],
        )
