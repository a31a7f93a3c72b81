"""The partitioner's stages on one graph, each a function of the graph's `GraphCompile` (backend/partition.py calls
them in order; the plan stage is backend/planning.py):

    capture         the frame's modules, the block map, the parameter map (capture.py)
    chunks_built    the model's chunks, where built already (by protrain_fx.prepare or an earlier graph)
    profile         one real iteration of the partitioned graphs, on every rank (profiler/), or the profiles the plan
                    cache kept (backend/cache.py)
    runtime_for     the swap space, step monitor and gradient source the rewritten graphs' ops reach
    rewrite         the plan carried out: joint passes, the partition again, forward and backward passes (passes/)
    attach_runtime  the swap space's slots and the chunks' expected gradients, for the graphs as rewritten
    open_dump, dump_plan, dump   the graph's files in the dump directory (debug/dump.py)
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._guards
from torch import fx
from torch._dynamo.guards import GuardBuilder
from torch._functorch.partitioners import must_recompute

from protrain_fx.backend.phases import phase_done
from protrain_fx.backend.record import RUNTIME_ATTR, GraphCompile, GraphRecord
from protrain_fx.backend.sizes import GraphSizes, step_predictor
from protrain_fx.capture import FrameRoots, build_block_map, build_param_map, find_frame_roots
from protrain_fx.debug.dump import GRAPHS_FILE, PLANNING_FILE, Dumper
from protrain_fx.passes.pipeline import GRAPH_PASSES, JOINT_PASSES, PassContext, run_passes
from protrain_fx.planner.calibrate import device_phases
from protrain_fx.planner.cost import Candidate, CostModel
from protrain_fx.planner.inputs import retimed
from protrain_fx.planner.plan import Plan
from protrain_fx.profiler.fusion import describe
from protrain_fx.profiler.hardware import device_capacity
from protrain_fx.profiler.interpreter import profile_iteration, profile_on_every_rank
from protrain_fx.profiler.on_demand import OnDemand
from protrain_fx.profiler.profile import GraphProfile
from protrain_fx.profiler.scaling import ProfileFit
from protrain_fx.profiler.selective import mark_selective, selective_marks
from protrain_fx.real_tensors import real_tensors
from protrain_fx.runtime.adopt import check_params_managed, model_manager
from protrain_fx.runtime.monitor import REPORT_FILE, StepMonitor
from protrain_fx.runtime.replan import REPLANNED_REPORT
from protrain_fx.runtime.swap import SwapSpace
from protrain_fx.shapes import at_sizes

log = logging.getLogger(__name__)

UNCOMPILED_BLOCKS_ATTR = "_protrain_told_uncompiled_blocks"  # on a model: warned that no graph runs its blocks
RAN_BLOCKS_ATTR = "_protrain_ran_blocks"  # on a model: a graph compiled so far runs some of its blocks
Cut = Callable[[fx.GraphModule], tuple[fx.GraphModule, fx.GraphModule]]  # a joint graph's forward and backward


def capture(c: GraphCompile, joint: fx.GraphModule) -> FrameRoots:
    """The frame's modules in the model, the block map and the parameter map (capture.py)."""
    record = c.record
    roots = find_frame_roots(c.dynamo_gm, c.example_inputs)
    pin_to_frame_modules(c.dynamo_gm, roots)
    record.block_map = build_block_map(joint, roots)
    record.param_map = build_param_map(c.dynamo_gm, c.example_inputs, joint, roots, record.block_map)
    if record.block_map.blocks_in_graph and _hf_checkpointing(roots.model) and not c.explain:  # (explain: untouched)
        roots.model.__dict__[RAN_BLOCKS_ATTR] = True
    if not record.block_map.families and record.param_map:
        log.warning(
            "graph %d has %d parameters but its model has no transformer blocks (no ModuleList of repeated "
            "modules): it is planned as one region, so no per-block checkpointing or swapping applies",
            record.index,
            len(record.param_map),
        )
    elif record.param_map and not record.block_map.blocks_in_graph and _hf_checkpointing(roots.model):
        roots.model.__dict__[UNCOMPILED_BLOCKS_ATTR] = True  # (said once per model)
        log.warning(
            "graph %d runs none of the model's blocks, and the model checkpoints its own layers "
            "(gradient_checkpointing_enable): Dynamo may have run them uncompiled (docs/limitations.md), so no plan "
            "reaches them. Set torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True before the "
            "first step, or call model.gradient_checkpointing_disable() and leave checkpointing to the plan",
            record.index,
        )
    return roots


def _hf_checkpointing(model) -> bool:
    """Whether a Hugging Face model checkpoints its own layers, no graph compiled so far runs any of them (a graph
    after the blocks runs none either), and it was not told so yet."""
    said = model is not None and (UNCOMPILED_BLOCKS_ATTR in model.__dict__ or RAN_BLOCKS_ATTR in model.__dict__)
    return bool(getattr(model, "is_gradient_checkpointing", False)) and not said


def pin_to_frame_modules(dynamo_gm: fx.GraphModule, roots: FrameRoots) -> None:
    """Guard the compiled graph on the identity of the modules its frame's locals are (Dynamo's ID_MATCH).
    Dynamo inlines modules and passes their parameters in, so without it a graph runs for any module whose
    guards pass: another model of the same class (a sweep), another layer running the same code (a frame that
    starts inside a layer after a graph break). Ours is rewritten for one model's chunks, swap space and plan.
    The guard also drops the cache entry when the module is deleted."""
    context = torch._guards.TracingContext.try_get()
    if context is None or roots.model is None:
        return
    sources = {}
    for node in dynamo_gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        while source is not None:  # (the chain from a parameter up to the frame's local)
            name = source.name() if callable(source.name) else source.name
            # the innermost of a name's sources: the local itself, not a wrapper of it (an unspecialized module's),
            # as Dynamo counts a frame's compiles per module only for an ID_MATCH on a local
            sources[name] = source
            source = getattr(source, "base", None)
    for prefix in roots.paths:
        if prefix in sources:
            context.guards_context.dynamo_guards.add(sources[prefix].make_guard(GuardBuilder.ID_MATCH))


def chunks_built(c: GraphCompile, roots: FrameRoots):
    """The model's ChunkManager where its chunks are built already (by protrain_fx.prepare or an earlier graph),
    checked to hold every parameter the graph reads; None where they are not."""
    manager = model_manager(roots.model)
    if manager is not None:
        check_params_managed(manager, c.record.param_map, c.example_inputs)
    return manager


def profile(c: GraphCompile, joint: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule, manager, model) -> None:
    """One profiled iteration of the partitioned graphs, the same on every rank (profiler/); on demand for a
    prepared model, and again on demand where the whole iteration runs out of GPU memory. A graph with symbolic
    sizes is profiled at two sizes, and its profile at any other fitted from them (backend/sizes.py)."""
    record = c.record
    start = time.perf_counter()
    sizes = GraphSizes.of(c.example_inputs, c.fakes, c.device)
    at = [sizes.first, sizes.second(next(sizes.bounds(c.config, model))[0])] if sizes is not None else [{}]
    profiles = record.cache.profiles(at) if record.cache is not None else None
    if profiles is not None:
        record.from_cache += ("profile",)
        _annotate(profiles[-1], fw, bw)
    else:
        profiles = [_profile_at(c, joint, fw, bw, manager, s) for s in at]
        record.seconds["profile"] = time.perf_counter() - start
        if record.cache is not None:
            record.cache.keep_profiles(at, profiles)
    if sizes is not None:
        record.fit = ProfileFit({"forward": fw, "backward": bw}, tuple(zip(at, profiles)))
        record.sizes = sizes
        log.info("graph %d has symbolic sizes; profiled at %s and %s", record.index, *(dict(s) for s in at))
    record.profile = profiles[0]
    phase_done(record.index, "profile", record.seconds.get("profile"), record.cache)


def _annotate(profiled: GraphProfile, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """`node.meta["protrain"]` of the graphs' nodes from a profile the cache kept, as profiling writes it."""
    for kind, gm in (("forward", fw), ("backward", bw)):
        named = {n.name: n for n in profiled.nodes if n.graph == kind}
        for node in gm.graph.nodes:
            if node.name in named:
                node.meta["protrain"] = named[node.name]


def _profile_at(c: GraphCompile, joint, fw, bw, manager, sizes: dict) -> GraphProfile:
    """The profile at the graph's symbolic `sizes` (none for a graph of fixed sizes), with its selective marks."""
    record, device, params = c.record, c.device, c.params
    with real_tensors():
        inputs = at_sizes(c.example_inputs, c.fakes, sizes)

    def iteration():
        if manager is not None:  # a prepared model: its offloaded parameters are fetched as they are used
            manager.wait_for_update()
            on_demand = OnDemand(manager, params)
            return profile_iteration(fw, bw, inputs, record.block_map, on_demand)
        try:
            return profile_iteration(fw, bw, inputs, record.block_map)
        except torch.OutOfMemoryError:
            log.warning(
                "graph %d: profiling ran out of GPU memory; profiling again with activations and gradients "
                "held only while used",
                record.index,
            )
        # what the failed iteration left: its frames can sit in reference cycles (context managers the error
        # passed through) that hold its tensors until the next garbage collection; then the allocator's cache
        gc.collect()
        torch.cuda.empty_cache()
        log.info(
            "graph %d: %.2f GiB allocated as profiling starts again",
            record.index,
            torch.cuda.memory_allocated(device) / 2**30,
        )
        return profile_iteration(fw, bw, inputs, record.block_map, OnDemand())

    profiled = profile_on_every_rank(iteration, device)
    if device.type == "cuda":  # the allocator gives back what it cached for an iteration that held all
        torch.cuda.empty_cache()
    # what a selective block of this graph would keep and recompute (profiler/selective.py), for the planner
    forward = {n.name: n for n in profiled.nodes if n.graph == "forward"}
    marks = selective_marks(joint.graph, record.block_map.block, record.block_map.region, sizes or None)
    mark_selective(forward, marks)
    return profiled


@dataclasses.dataclass(frozen=True)
class GraphRuntime:
    """What the rewritten graphs' custom ops reach at run time (runtime/ops.py), by weak handle or id."""

    manager: Any  # the model's ChunkManager, None when not chunked
    swap: SwapSpace | None  # the graph's swapped activations, None when no block swaps
    monitor: StepMonitor | None  # its step marks' monitor, None when neither dumped nor re-planned
    grad_source: int  # its frame, as the ChunkManager counts gradients (runtime/chunks/arrivals.py)


def runtime_for(c: GraphCompile, roots: FrameRoots, manager) -> GraphRuntime:
    """The swap space (where a block swaps), the step monitor and the gradient source of the graph, for the passes
    to hand to the ops; the swap space and monitor kept on the model (the ops hold them weakly)."""
    record, config, device = c.record, c.config, c.device
    swap = None
    if "swap" in record.plan.block_modes:
        limits = (record.plan.predicted_peak_bytes, config.gpu_memory_bytes, device_capacity(device))
        budget = min((limit for limit in limits if limit), default=None)  # prefetch within the tightest
        swap = SwapSpace(device, budget_bytes=budget, upload_stream=manager.upload_stream if manager else None)
    monitor = _monitor(c, roots, manager)
    for runtime_object in (swap, monitor):  # the ops reach them by weak handle: the model keeps them alive
        if runtime_object is not None:
            roots.model.__dict__.setdefault(RUNTIME_ATTR, []).append(runtime_object)
    if manager is not None and record.grad_source is None:  # (kept by a re-plan, which compiles outside Dynamo)
        # the frame and the modules its locals are: recompiles for other input shapes share it (one of them
        # runs), those for other modules running the same code (one graph per layer) do not
        compile_id = torch._guards.CompileContext.current_compile_id()
        frame = compile_id.frame_id if compile_id is not None else ("graph", record.index)
        record.grad_source = manager.arrivals.source((frame, tuple(sorted(roots.paths.values()))))
    return GraphRuntime(manager=manager, swap=swap, monitor=monitor, grad_source=record.grad_source or 0)


def _monitor(c: GraphCompile, roots: FrameRoots, manager) -> StepMonitor | None:
    """The step monitor of a model's graph that is dumped, or that the closed loop will re-plan (a graph of no
    model, a loss after a graph break, has nothing to keep it alive: none there)."""
    record, loop = c.record, c.loop
    if not (record.dumper or (loop is not None and loop.watches(record))) or roots.model is None:
        record.monitor = None
        return None
    hardware = record.costs.hardware if record.costs is not None else None
    retime = (
        functools.partial(retimed, record.costs, record.planning, record.plan)
        if record.costs is not None and record.planning is not None
        else None
    )
    phases = functools.partial(device_phases, record.costs, record.plan) if record.costs is not None else None
    report = REPLANNED_REPORT if loop is not None and loop.switched else REPORT_FILE
    record.monitor = StepMonitor(
        c.device,
        record.plan,
        record.dumper,
        manager=manager,
        hardware=hardware,
        retime=retime,
        phases=phases,
        at_sizes=step_predictor(record, c.example_inputs),
        report_file=report,
    )
    return record.monitor


def rewrite(
    c: GraphCompile,
    joint: fx.GraphModule,
    graphs: tuple[fx.GraphModule, fx.GraphModule],
    runtime: GraphRuntime,
    cut: Cut,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The plan carried out (passes/): the joint passes and the partition again (`cut`) where blocks are
    recomputed, then the forward and backward passes, which hand `runtime` to the ops they insert; (forward,
    backward). `graphs`: the forward and backward as first partitioned."""
    record = c.record
    fw, bw = graphs
    ctx = PassContext(
        config=c.config,
        plan=record.plan,
        record=record,
        dumper=record.dumper,
        manager=runtime.manager,
        example_inputs=c.example_inputs,
    )
    joint = run_passes(joint, ctx, JOINT_PASSES, stage="joint")
    if any(must_recompute(n) for n in joint.graph.nodes):  # recompute tags change the partition: cut again
        fw, bw = cut(joint)
    saved = frozenset(n.name for n in bw.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents"))
    ctx = dataclasses.replace(
        ctx,
        saved=saved,
        needed_from=record.block_map.needed_from(bw.graph),
        swap=runtime.swap,
        monitor=runtime.monitor,
        grad_source=runtime.grad_source,
    )
    fw = run_passes(fw, ctx, GRAPH_PASSES, stage="forward")
    output = next(n for n in fw.graph.nodes if n.op == "output")
    ctx = dataclasses.replace(
        ctx,
        forward_placeholders=[n for n in fw.graph.nodes if n.op == "placeholder"],
        forward_outputs=[a for a in output.args[0] if isinstance(a, fx.Node)],
    )
    bw = run_passes(bw, ctx, GRAPH_PASSES, stage="backward")
    return fw, bw


def attach_runtime(c: GraphCompile, runtime: GraphRuntime, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """The run-time objects fitted to the rewritten graphs: the swap space's slots for what the forward swaps out,
    and the gradients each chunk awaits from the backward's reductions."""
    if runtime.swap is not None:
        outs = sorted(
            fw.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default),
            key=lambda n: n.args[1],
        )
        at = c.record.shapes.at_largest if c.record.shapes is not None else int  # (symbolic sizes: the largest)
        with real_tensors():  # the partitioner runs under AOTAutograd's fake mode
            runtime.swap.allocate([_at_sizes(n.meta["val"], at) for n in outs])
        c.record.swap = runtime.swap
    if runtime.manager is not None:
        for node in bw.graph.find_nodes(op="call_function", target=torch.ops.protrain.reduce_grads.default):
            runtime.manager.arrivals.expect(node.args[1], node.args[2])


def _at_sizes(t: torch.Tensor, at) -> torch.Tensor:
    """`t`'s dtype and dense layout on the meta device, each size (and stride) given by `at`."""
    return torch.empty_strided([at(d) for d in t.shape], [at(s) for s in t.stride()], dtype=t.dtype, device="meta")


def open_dump(c: GraphCompile, joint: fx.GraphModule) -> Dumper | None:
    """The graph's Dumper (None: not dumped), kept on its record, with the joint graph written: a new one per
    compile, except for a re-plan from the measured steps, whose files go beside the first plan's."""
    record = c.record
    if c.config.dump_dir and c.switching is None:
        record.dumper = Dumper(c.config.dump_dir)
    if record.dumper:
        record.dumper.write_text("joint.py", joint.print_readable(print_output=False))
    return record.dumper


def dump_plan(dumper: Dumper, record: GraphRecord, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """What the plan was searched from and what it decided, and the graphs as profiled (every block saving all it
    saves, before any pass or re-cut for the plan: what profiler/fusion.py classified, for debug/from_dump.py), with
    the profile: an explain run's dump is planned again from these files alone."""
    dumper.write_text("profile.csv", record.profile.to_csv())
    dumper.write_json("profile.json", record.profile.to_json())
    dumper.write_json("plan.json", record.plan.to_json())
    dumper.write_json("seconds.json", record.seconds)
    if record.costs is not None:
        dumper.write_json("costs.json", _cost_terms(record.costs, record.plan))
    if record.planning is not None:
        dumper.write_json(PLANNING_FILE, record.planning.to_json())
    dumper.write_json(GRAPHS_FILE, {"forward": describe(fw.graph), "backward": describe(bw.graph)})


def _cost_terms(costs: CostModel, plan: Plan) -> dict[str, Any]:
    """The plan's predicted step split into its terms, and what the models read (costs.json of a dump)."""
    config = Candidate.of(plan)
    costs = dataclasses.replace(costs, forced_modes=plan.block_modes)
    return {
        **costs.phases(config),
        "activation_peak_bytes": costs.activation_peak(plan.block_modes),
        "state_bytes": costs.state_bytes(config),
        "other_bytes": costs.other_bytes,
        "alpha": costs.alpha,
        "backward_matmul_share": costs.backward_matmul_share,
        "matmul_stretch": costs.matmul_stretch,
        "swap_interval": costs.swap_interval,
        "block_fwd_s": costs.block_fwd_s,
        "block_bwd_s": costs.block_bwd_s,
        "block_saved_bytes": costs.block_saved,
    }


def dump(record: GraphRecord) -> None:
    """The final forward and backward to the debug log, and with the maps to the dump directory."""
    if log.isEnabledFor(logging.DEBUG):  # (printing a large graph takes seconds)
        log.debug("graph %d forward:\n%s", record.index, record.forward.print_readable(print_output=False))
        log.debug("graph %d backward:\n%s", record.index, record.backward.print_readable(print_output=False))
    dumper = record.dumper
    if not dumper:
        return
    dumper.write_text("forward.py", record.forward.print_readable(print_output=False))
    dumper.write_text("backward.py", record.backward.print_readable(print_output=False))
    dumper.write_json("params.json", {k: v.to_json() for k, v in record.param_map.items()})
    dumper.write_json("blocks.json", record.block_map.to_json())
