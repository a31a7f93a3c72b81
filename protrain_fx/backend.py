"""The `protrain` torch.compile backend: capture -> profile -> plan -> passes -> executor, per Dynamo graph.

Dynamo hands each graph (with its real example inputs) to `protrain`. AOTAutograd traces the joint
forward+backward graph and calls our partitioner (`_Partitioner`) on it, which is where our stages run:

    joint graph --capture--> param map, block map
               --partition (min-cut, as inductor does)--> forward, backward graphs
               --profile--> one real iteration, NodeProfile on every node (tensors on demand when too large)
               --plan--> Plan --passes--> rewritten forward, backward --executor--> inductor | eager FX

With the inductor executor the partitioner is installed through inductor's `custom_partitioner_fn`
option, so everything else inductor does (its decompositions, joint-graph and post-grad passes) is
unchanged. With the eager executor, AOTAutograd runs the graphs as FX modules.
Graphs compiled without autograd (inference under `torch.no_grad()`) have no joint graph and are
compiled with no profile or plan; where the model has offloaded chunks, `_InferencePasses` gives them the
forward chunk passes (their parameters hold no values).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch._guards
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.guards import GuardBuilder
from torch._dynamo.source import LocalSource
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition, must_recompute
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from protrain_fx.capture import (
    BlockMap,
    FrameRoots,
    ParamEntry,
    build_block_map,
    build_param_map,
    check_inputs,
    find_frame_roots,
    frame_self,
    open_modules,
)
from protrain_fx.config import ProTrainConfig
from protrain_fx.debug.dump import GRAPHS_FILE, PLANNING_FILE, Dumper
from protrain_fx.distributed import least_on_every_rank
from protrain_fx.passes.pipeline import GRAPH_PASSES, INFERENCE_PASSES, JOINT_PASSES, PassContext, run_passes
from protrain_fx.planner.calibrate import calibrated
from protrain_fx.planner.cost import Candidate, CostModel, swap_interval
from protrain_fx.planner.inputs import PlanningInputs, cost_model, retimed, settled
from protrain_fx.planner.plan import (
    ACTIVATION_FIELDS,
    CHUNK_FIELDS,
    OUTPUT_FIELDS,
    Plan,
    with_default_master,
)
from protrain_fx.planner.search import NoPlanFits, plan_graph
from protrain_fx.profiler.fusion import describe
from protrain_fx.profiler.hardware import device_capacity, hardware_profile, host_capacity
from protrain_fx.profiler.interpreter import profile_iteration, profile_on_every_rank
from protrain_fx.profiler.on_demand import OnDemand, storage_key
from protrain_fx.profiler.profile import GraphProfile
from protrain_fx.profiler.selective import mark_selective, selective_marks
from protrain_fx.real_tensors import real_tensors
from protrain_fx.runtime.adopt import (
    build_manager,
    check_params_managed,
    model_layout,
    model_manager,
    pass_through_ddp,
    place_chunks,
    plan_fields_of,
    updates_wait,
    wants_chunks,
)
from protrain_fx.runtime.chunks import MANAGER_ATTR
from protrain_fx.runtime.monitor import REPORT_FILE, StepMonitor
from protrain_fx.runtime.oom import Replanning, device_state, first_line, plan_summary
from protrain_fx.runtime.ops import register_inductor_lowering
from protrain_fx.runtime.replan import REPLAN_FILE, REPLANNED_REPORT, ClosedLoop, moves_chunks
from protrain_fx.runtime.swap import SwapSpace

log = logging.getLogger(__name__)

MIN_TORCH = (2, 11)
RUNTIME_ATTR = "_protrain_runtime"  # on the model: the swap spaces and step monitors of its graphs
PLANS_ATTR = "_protrain_plans"  # on the model: (parameters read, Plan) of each graph compiled for training


@dataclasses.dataclass
class GraphRecord:
    """Everything the backend learned and decided about one compiled graph, kept for inspection."""

    index: int
    param_map: dict[str, ParamEntry] = dataclasses.field(default_factory=dict)
    block_map: BlockMap | None = None
    profile: GraphProfile | None = None
    plan: Plan | None = None
    costs: Any = None  # the CostModel the plan was searched with (planner/cost.py)
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    swap: Any = None  # the SwapSpace of its swapped activations (runtime/swap.py), None when no block swaps
    monitor: Any = None  # its StepMonitor (runtime/monitor.py): with a dump directory, or to re-plan it
    capacity: int | None = None  # the GPU bytes its plan was searched under (None: not budgeted, on the CPU)
    model: Any = None  # weak reference to the model whose graph it is
    manager: Any = None  # weak reference to the model's ChunkManager, None when not chunked
    grad_source: int | None = None  # its frame's id for the ChunkManager (ChunkManager.grad_source)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # wall time of profile, hardware, search
    planning: PlanningInputs | None = None  # the planner's inputs besides the profile (a dump's planning.json)
    dumper: Any = None  # its Dumper (debug/dump.py), where dumped: a re-plan's files go beside the first plan's
    key: object = dataclasses.field(default_factory=object, repr=False)  # the graph's, among those reading chunks


def check_torch_version(version: str = torch.__version__) -> None:
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    if (major, minor) < MIN_TORCH:
        raise RuntimeError(f"protrain needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {version}; upgrade torch")


class ProTrainBackend:
    """A torch.compile backend object: `torch.compile(model, backend=ProTrainBackend(options))`.

    `backend="protrain"` makes one per graph; passing an instance keeps every graph's `GraphRecord` in
    `.graphs`, in compile order, for inspection after the fact.
    """

    def __init__(self, options: dict[str, Any] | ProTrainConfig | None = None, *, explain: bool = False):
        self.config = ProTrainConfig.from_options(options)
        self.graphs: list[GraphRecord] = []
        self.explain = explain  # plan only (protrain_fx.explain): no chunks built, graphs left as they are

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        check_torch_version()
        check_inputs(gm, example_inputs)
        pass_through_ddp([x for x in example_inputs if isinstance(x, nn.Parameter)])
        record = GraphRecord(index=len(self.graphs))
        self.graphs.append(record)
        if self.explain:
            return self.compile(gm, example_inputs, record)
        lend = _lent_at_break(gm, example_inputs)
        if not torch.is_grad_enabled():
            compiled = self.compile(gm, example_inputs, record)
        else:
            compiled = _Guarded(self, gm, example_inputs, record)
        return _Run(compiled, record, example_inputs, lend) if record.manager is not None or lend else compiled

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], record: GraphRecord, guard=None):
        """Compile one Dynamo graph: our stages run in AOTAutograd's partitioner. `guard`: the graph's `_Guarded`
        (out-of-memory handling), whose config is ours with the capacity of its last re-plan."""
        config = guard.replanning.config if guard is not None else self.config
        partitioner = _Partitioner(config, record, gm, list(example_inputs), explain=self.explain, guard=guard)
        manager = None if torch.is_grad_enabled() else _offloaded_manager(example_inputs)
        inference = _InferencePasses(config, record, gm, list(example_inputs), manager) if manager else None
        log.info(
            "compiling graph %d (%d nodes) with the %s executor", record.index, len(gm.graph.nodes), config.executor
        )
        try:
            if config.executor == "inductor":
                from torch._functorch import config as functorch_config
                from torch._inductor.compile_fx import compile_fx

                register_inductor_lowering()
                # no cache of whole graphs (AOTAutograd's, inductor's FX graph cache): a cached compile would skip
                # the profile and the plan. Inductor's kernel caches stay: a kernel is keyed by its source, so a
                # later compile (or run) reuses it rather than compiling every kernel again in a fresh cache
                # directory, as force_disable_caches does (leaving that directory behind)
                patches = {
                    "custom_partitioner_fn": partitioner,
                    "fx_graph_cache": False,
                    "fx_graph_remote_cache": False,
                }
                inner = functools.partial(_inductor_inner_compile, inference, guard)
                with functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
                    return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
            eager = make_boxed_compiler(lambda g, _: g)
            more = {"inference_compiler": make_boxed_compiler(lambda g, _: inference(g))} if inference else {}
            if guard is not None:
                more["bw_compiler"] = lambda g, _: guard.backward(make_boxed_func(g), g)
            compiler = aot_autograd(**{"fw_compiler": eager, "bw_compiler": eager, "partition_fn": partitioner, **more})
            return compiler(gm, example_inputs)
        finally:  # (inductor's config cache keeps the last partitioner: it must not keep a dropped model's chunks)
            partitioner.forget()
            if inference is not None:
                inference.forget()


class _Guarded:
    """What Dynamo runs for one training graph: the compiled graph, whose out-of-memory errors name the plan
    or, under on_oom="replan", re-plan it (the table in runtime/oom.py), and which re-plans it once from what its
    first steps measured, under replan="on" (runtime/replan.py)."""

    def __init__(self, backend: ProTrainBackend, gm: fx.GraphModule, example_inputs: Sequence[Any], record):
        self.backend, self.gm, self.record = backend, gm, record
        self.device = _device_of(example_inputs)
        self.replanning = Replanning(backend.config, self.device)
        self.loop = ClosedLoop(self.device) if backend.config.replan == "on" else None
        self.switching: tuple[Plan, CostModel] | None = None  # the plan and cost model the compile puts in force
        reason = getattr(gm, "compile_subgraph_reason", None)
        self.graph_break = reason is not None and reason.graph_break
        # where each input comes from (capture.py reads it), which Dynamo deletes once the graph is compiled
        self.graphargs = {n: n.meta["grapharg"] for n in gm.graph.find_nodes(op="placeholder") if "grapharg" in n.meta}
        self.compiled = backend.compile(gm, example_inputs, record, self)

    def __call__(self, *args):
        if self.replanning.due:  # (a backward ran out of memory)
            self._recompile(args, "backward", "", "(in the last step)")
        if self.loop is not None and self.loop.due(self.record.monitor):
            self._close_loop(args)
        while True:
            try:
                return self.compiled(*args)
            except torch.OutOfMemoryError as error:
                state, cause = device_state(self.device), first_line(error)
            # (out of the except block: the failed forward's tensors went with its frames)
            self._abandon()
            if not self._replan():
                raise self._error("forward", state, cause)
            self._recompile(args, "forward", state, cause)

    def backward(self, compiled, gm: fx.GraphModule):
        """The compiled backward (boxed), losing its step instead of failing when it runs out of memory under
        on_oom="replan": its outputs are then all None (the parameters' gradients live in chunks)."""
        n_outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])

        def run(args: list) -> list:
            try:
                return compiled(args)
            except torch.OutOfMemoryError as error:
                state, cause = device_state(self.device), first_line(error)
            args.clear()  # the saved activations
            self._abandon()
            manager = self._manager()
            started = manager.updates_started() if manager is not None else []
            replanned = self._replan()
            if not replanned or manager is None or started:
                why = (
                    "re-planned for the next step, but this step's weights were partly updated already ("
                    f"chunks {started} had started): resume from the last checkpoint"
                    if started
                    else "re-planned for the next step, but only protrain_fx.optim.AdamW can skip this lost step: "
                    "call optimizer.zero_grad() and go on"
                )
                raise self._error("backward", state, cause, why=why if replanned else "")
            manager.lose_step()
            log.warning(
                "graph %d: the backward ran out of GPU memory; this step is lost (the optimizer step skips it) and "
                "the graph is re-planned before its next forward",
                self.record.index,
            )
            return [None] * n_outputs

        run._boxed_call = True
        return run

    def _replan(self) -> bool:
        """Lower the capacity for a re-plan before the next forward; False when that is not possible."""
        if not self.replanning.lower(self.record.capacity):
            return False
        self.replanning.due = True
        return True

    def _manager(self):
        """The model's ChunkManager, None when the graph is not chunked."""
        return self.record.manager() if self.record.manager is not None else None

    def _abandon(self) -> None:
        manager = self._manager()
        if manager is not None:
            manager.abandon_step()
        if self.record.swap is not None:
            self.record.swap.abandon()

    def _error(self, where: str, state: str, cause: str, *, why: str = "") -> torch.OutOfMemoryError:
        record = self.record
        return self.replanning.error(where, record.index, record.plan, record.capacity, state, cause, why=why)

    def _recompile(self, args: Sequence[Any], where: str, state: str, cause: str) -> None:
        """The graph again, planned under the lowered capacity from its profile (not profiled again); with the
        model's chunks as built, only the activation fields change. `where`, `state`, `cause`: of the out-of-memory
        error that asked for it, for the error if no plan fits."""
        self.replanning.due = False
        try:
            self._compile_again(args)
        except NoPlanFits as error:
            why = f"re-planned under {self.replanning.config.gpu_memory_bytes} bytes, where {error}"
            raise self._error(where, state, cause, why=why) from None
        log.warning("graph %d re-planned:\n%s", self.record.index, self.record.plan)

    def _close_loop(self, args: Sequence[Any]) -> None:
        """The closed loop (runtime/replan.py): where the calibrated search's plan is enough faster, the model's
        chunks placed again for it where its chunk fields differ, and the graph compiled again with it."""
        record, manager = self.record, self._manager()
        replan = self.loop.decide(record, manager, self._chunks_may_move(manager))
        if replan is None:
            if self.loop.done:
                self._dump_replan()
            return
        before = record.plan
        if manager is not None and moves_chunks(replan.plan, manager):
            plan = replan.plan
            if not manager.place_again(plan.n_persist, plan.n_buffer, plan.host_grad_slots, plan.device_grad_slots):
                self.loop.switched = False
                self._dump_replan()
                return
        self.switching = (replan.plan, self.loop.costs)
        try:
            self._compile_again(args)
        finally:
            self.switching = None
        self._dump_replan()
        log.warning(
            "graph %d re-planned from what training measured (%s): the calibrated search's plan is predicted at "
            "%.2f ms a step (%.2f ms as ranked), the plan in force at %.2f ms (%.2f ms as ranked): %.1f%% faster, "
            "over the %.1f%% a switch needs\nbefore: %s\nafter:  %s\n%s",
            record.index,
            self.loop.calibration,
            replan.plan.predicted_step_s * 1e3,
            replan.ranked_s * 1e3,
            replan.before.predicted_step_s * 1e3,
            replan.before_ranked_s * 1e3,
            replan.gain * 100,
            replan.margin * 100,
            plan_summary(before),
            plan_summary(record.plan),
            record.plan,
        )

    def _chunks_may_move(self, manager) -> bool:
        """Whether a re-plan may place the model's chunks again: this graph is the only compiled graph reading them,
        and ends in no graph break (the other graphs, and the Python after a break, read them where they are)."""
        return manager is not None and not self.graph_break and manager.graphs_reading == {self.record.key}

    def _dump_replan(self) -> None:
        if self.record.dumper is not None:
            self.record.dumper.write_json(REPLAN_FILE, self.loop.to_json())

    def _compile_again(self, args: Sequence[Any]) -> None:
        """The graph compiled again from its stored profile (its swap space and monitor made anew)."""
        record = self.record
        model = record.model() if record.model is not None else None
        if model is not None:  # its swap space and monitor go (the ops hold them weakly: the model keeps them)
            old = [o for o in (record.swap, record.monitor) if o is not None]
            kept = [o for o in model.__dict__.get(RUNTIME_ATTR, []) if all(o is not x for x in old)]
            model.__dict__[RUNTIME_ATTR] = kept
        record.swap = record.monitor = self.compiled = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for node, grapharg in self.graphargs.items():
            node.meta.setdefault("grapharg", grapharg)
        self.compiled = self.backend.compile(self.gm, args, record, self)


def _pin_to_frame_modules(dynamo_gm: fx.GraphModule, roots: FrameRoots) -> None:
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
            sources.setdefault(name, source)
            source = getattr(source, "base", None)
    for prefix in roots.paths:
        if prefix in sources:
            context.guards_context.dynamo_guards.add(sources[prefix].make_guard(GuardBuilder.ID_MATCH))


def _lent_at_break(dynamo_gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[object, list[int]] | None:
    """A graph that ends in a graph break inside modules (capture.open_modules): Python runs the rest of their
    forward, maybe outside any compiled graph (a loop over data-dependent values), so once the graph has run, their
    offloaded parameters get their values (`ChunkManager.lend_to_python`). Their manager and indices, or None."""
    reason = getattr(dynamo_gm, "compile_subgraph_reason", None)
    if reason is None or not reason.graph_break:
        return None
    own = [
        p
        for m in open_modules(dynamo_gm, find_frame_roots(dynamo_gm, example_inputs))
        for p in m.parameters(recurse=False)
    ]
    manager = next((p.__dict__[MANAGER_ATTR] for p in own if MANAGER_ATTR in p.__dict__), None)
    if manager is None:  # (the chunks of a model are built at its first graph: none before)
        return None
    indices = sorted({manager.index[id(p)] for p in own if manager.holds(p) and not manager.is_persistent(p)})
    if not indices:
        return None
    context = torch._guards.TracingContext.try_get()
    if context is not None and frame_self() is not None:  # (these modules' parameters, not another's)
        context.guards_context.dynamo_guards.add(LocalSource("self").make_guard(GuardBuilder.ID_MATCH))
    return manager, indices


class _Run:
    """What Dynamo calls for one compiled graph of a chunked model: the graph, after checking that its parameter
    inputs are still the chunks' (a parameter replaced after the chunks were built is an error, not silently
    stale values; checked on what Dynamo passes, before a compiler copies an input into another layout), and
    followed by lending parameters to Python where the graph ends inside a module's forward (`_lent_at_break`)."""

    def __init__(self, compiled, record: GraphRecord, example_inputs: Sequence[Any], lend):
        self.compiled = compiled
        manager = record.manager() if record.manager is not None else None
        entries = [
            e for e in record.param_map.values() if manager is not None and manager.holds(example_inputs[e.index])
        ]
        self.positions = [e.index for e in entries]
        self.indices = [manager.index[id(example_inputs[e.index])] for e in entries]
        self.manager = record.manager
        self.lend = (weakref.ref(lend[0]), lend[1]) if lend is not None else None

    def __call__(self, *args):
        manager = self.manager() if self.manager is not None else None
        if manager is not None:
            manager.check_params(self.indices, [args[i] for i in self.positions])
        out = self.compiled(*args)
        lender = self.lend[0]() if self.lend is not None else None
        if lender is not None:
            lender.lend_to_python(self.lend[1], for_backward=torch.is_grad_enabled())
        return out


def _offloaded_manager(example_inputs: Sequence[Any]):
    """The ChunkManager of a graph's parameters when some of them are offloaded (they hold no values)."""
    for x in example_inputs:
        manager = x.__dict__.get(MANAGER_ATTR) if isinstance(x, nn.Parameter) else None
        if manager is not None and not manager.is_persistent(x):
            return manager
    return None


def _inductor_inner_compile(inference: _InferencePasses | None, guard, gm: fx.GraphModule, example_inputs, **kwargs):
    """Inductor's per-graph compile, with the inference graph rewritten first (training graphs come rewritten
    by the partitioner) and the backward under the graph's out-of-memory guard."""
    from torch._inductor.compile_fx import compile_fx_inner

    if kwargs.get("is_inference") and inference is not None:
        gm = inference(gm)
    compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    return guard.backward(compiled, gm) if kwargs.get("is_backward") and guard is not None else compiled


class _InferencePasses:
    """The graph AOTAutograd compiles for inference (under no_grad, or inference mode, it runs no partitioner) of
    a model with offloaded chunks: the forward chunk passes, so it reads those parameters through gather and
    release. Nothing is profiled or planned: the chunks are the model's, and no activation is kept for a
    backward."""

    def __init__(self, config: ProTrainConfig, record: GraphRecord, dynamo_gm, example_inputs: list, manager):
        self.config, self.record, self.dynamo_gm = config, record, dynamo_gm
        self.example_inputs, self.manager = example_inputs, manager

    def forget(self) -> None:
        """Drop the graph and its inputs (the model's parameters among them) once the compile is done."""
        self.dynamo_gm = self.example_inputs = self.record = self.manager = None

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        record = self.record
        assert record is not None, f"the inference passes of {gm} ran after its compile was done"
        roots = find_frame_roots(self.dynamo_gm, self.example_inputs)
        _pin_to_frame_modules(self.dynamo_gm, roots)
        record.param_map = build_param_map(self.dynamo_gm, self.example_inputs, gm, roots)
        check_params_managed(self.manager, record.param_map, self.example_inputs)
        self.manager.note_read_by_graph((self.example_inputs[e.index] for e in record.param_map.values()), record.key)
        plans = roots.model.__dict__.get(PLANS_ATTR) if roots.model is not None else None
        record.plan = plans[-1][1] if plans else None  # (the training plan in force, for plan_of and the dump)
        dumper = Dumper(self.config.dump_dir) if self.config.dump_dir else None
        ctx = PassContext(
            config=self.config,
            plan=record.plan,
            record=record,
            dumper=dumper,
            manager=self.manager,
            example_inputs=self.example_inputs,
        )
        record.forward = run_passes(gm, ctx, INFERENCE_PASSES, stage="forward")
        record.manager = weakref.ref(self.manager)
        log.info("graph %d: an inference graph, its offloaded chunks gathered as used", record.index)
        return record.forward


def _input_shapes(example_inputs: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter)]


SHAPES_ATTR = "_protrain_input_shapes"  # on the model: graph's parameter count -> input shapes it was planned for


def _warn_if_reshaped(model: nn.Module, record: GraphRecord, example_inputs: Sequence[Any]) -> None:
    """A graph of this model compiled before for other input shapes (a new batch size or sequence length):
    each shape gets its own compile, profile and plan; say so once per new shape."""
    shapes = _input_shapes(example_inputs)
    seen = model.__dict__.setdefault(SHAPES_ATTR, {})
    before = seen.get(len(record.param_map))
    if before is not None and before != shapes:
        log.warning(
            "graph %d recompiled for input shapes %s (planned before for %s): each input shape gets its own "
            "compile, profile and plan, which takes time and host memory; pad the inputs to one fixed shape "
            "(batch size and sequence length) to keep one plan",
            record.index,
            shapes,
            before,
        )
    seen[len(record.param_map)] = shapes


def make_boxed_compiler(compile_fn):
    def compiler(gm: fx.GraphModule, example_inputs):
        return make_boxed_func(compile_fn(gm, example_inputs))

    return compiler


def protrain(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None, **_: Any):
    """The registered backend: `torch.compile(model, backend="protrain", options={...})`."""
    return ProTrainBackend(options)(gm, example_inputs)


class _Partitioner(CustomPartitionerFn):
    """Our stages, run on AOTAutograd's joint graph in place of its partitioner (see the module docstring)."""

    def __init__(
        self,
        config: ProTrainConfig,
        record: GraphRecord,
        dynamo_gm: fx.GraphModule,
        example_inputs,
        *,
        explain=False,
        guard: _Guarded | None = None,
    ):
        self.config = config
        self.record = record
        self.dynamo_gm = dynamo_gm
        self.example_inputs = example_inputs
        self.explain = explain
        self.guard = guard  # out-of-memory handling of a training graph (runtime/oom.py)

    def uuid(self) -> None:
        return None  # never cache: each compile profiles its own graph

    def forget(self) -> None:
        """Drop the graph and its inputs (the model's parameters among them) once the compile is done."""
        self.dynamo_gm = self.example_inputs = self.record = self.guard = None

    def __deepcopy__(self, memo):
        return self  # inductor copies its config, which holds us; our inputs are real tensors, not copyable

    def __call__(self, joint: fx.GraphModule, joint_inputs, **kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The flow of one graph, stage by stage (docs/design.md): capture, partition, profile, plan (and the
        model's chunks), rewrite, each a method below."""
        record = self.record
        assert record is not None, f"the partitioner of {joint} ran after its compile was done"
        roots = self._capture(joint)
        switching = self.guard is not None and self.guard.switching is not None  # (a re-plan: runtime/replan.py)
        dumper = Dumper(self.config.dump_dir) if self.config.dump_dir and not switching else record.dumper
        record.dumper = dumper
        if dumper:
            dumper.write_text("joint.py", joint.print_readable(print_output=False))
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        params = [self.example_inputs[e.index] for e in record.param_map.values()]
        manager = model_manager(roots.model)
        if manager is not None:
            check_params_managed(manager, record.param_map, self.example_inputs)
        device = _device_of(self.example_inputs)
        if record.profile is None:  # (a re-plan after running out of memory reuses the graph's profile)
            self._profile(joint, fw, bw, params, manager, device)
        manager = self._plan_and_chunks(roots, params, manager, device, bw)
        if dumper and not switching:  # (a re-plan's plan goes to replan.json, beside the first)
            _dump_plan(dumper, record, fw, bw)
        if self.explain and manager is None:
            record.forward, record.backward = fw, bw
            return fw, bw
        # (a prepared model's graphs are rewritten even to explain: its offloaded parameters hold no values, so
        # the forward that compiling runs needs its chunks gathered)
        fw, bw = self._rewrite(joint, joint_inputs, kwargs, (fw, bw), roots, manager, device, dumper)
        record.forward, record.backward = fw, bw
        log.debug("graph %d forward:\n%s", record.index, fw.print_readable(print_output=False))
        log.debug("graph %d backward:\n%s", record.index, bw.print_readable(print_output=False))
        if dumper:
            _dump(dumper, record)
        return fw, bw

    def _capture(self, joint: fx.GraphModule) -> FrameRoots:
        """The frame's modules in the model, the block map and the parameter map (capture.py)."""
        record = self.record
        roots = find_frame_roots(self.dynamo_gm, self.example_inputs)
        _pin_to_frame_modules(self.dynamo_gm, roots)
        record.block_map = build_block_map(joint, roots)
        record.param_map = build_param_map(self.dynamo_gm, self.example_inputs, joint, roots, record.block_map)
        if not record.block_map.families and record.param_map:
            log.warning(
                "graph %d has %d parameters but its model has no transformer blocks (no ModuleList of repeated "
                "modules): it is planned as one region, so no per-block checkpointing or swapping applies",
                record.index,
                len(record.param_map),
            )
        return roots

    def _profile(self, joint, fw, bw, params, manager, device: torch.device) -> None:
        """One profiled iteration of the partitioned graphs, the same on every rank (profiler/); on demand for a
        prepared model, and again on demand where the whole iteration runs out of GPU memory."""
        record = self.record

        def profile():
            if manager is not None:  # a prepared model: its offloaded parameters are fetched as they are used
                manager.wait_for_update()
                on_demand = OnDemand(manager, params)
                return profile_iteration(fw, bw, self.example_inputs, record.block_map, on_demand)
            try:
                return profile_iteration(fw, bw, self.example_inputs, record.block_map)
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
            return profile_iteration(fw, bw, self.example_inputs, record.block_map, OnDemand())

        start = time.perf_counter()
        record.profile = profile_on_every_rank(profile, device)
        record.seconds["profile"] = time.perf_counter() - start
        if device.type == "cuda":  # the allocator gives back what it cached for an iteration that held all
            torch.cuda.empty_cache()
        # what a selective block of this graph would keep and recompute (profiler/selective.py), for the planner
        forward = {n.name: n for n in record.profile.nodes if n.graph == "forward"}
        mark_selective(forward, selective_marks(joint.graph, record.block_map.block, record.block_map.region))

    def _plan_and_chunks(self, roots: FrameRoots, params, manager, device: torch.device, bw):
        """The plan (planner/), and the model's chunks where it gets them: built for the plan at the model's first
        graph, or a prepared model's placed by it. Returns the model's chunk manager (None: no chunks)."""
        record, config = self.record, self.config
        if manager is None and (wants_chunks(params) or (self.explain and any(p.requires_grad for p in params))):
            layout = model_layout(roots, record, self.example_inputs, config.plan, every_trainable=self.explain)
            self.config = config = dataclasses.replace(config, plan=with_default_master(config.plan, layout))
            record.plan = self._plan(config.plan, layout, device, bw, roots.model, None)
            if not self.explain:
                manager = self._build_chunks(roots.model, layout, device, bw)
        else:
            # a graph without parameters (a loss after a graph break) has no chunk or block decisions to check
            unplanned = OUTPUT_FIELDS + CHUNK_FIELDS + (ACTIVATION_FIELDS if not record.block_map.families else ())
            forced = config.plan if params else {k: v for k, v in config.plan.items() if k not in unplanned}
            if manager is not None:
                forced = plan_fields_of(manager, forced)
            layout = manager.layout if manager else None
            if self.guard is not None and self.guard.switching is not None:  # (placed for it: runtime/replan.py)
                record.plan, record.costs = self.guard.switching
            else:
                record.plan = self._plan(forced, layout, device, bw, roots.model, manager)
            if manager is not None and manager.pending_plan is not None and params:
                place_chunks(manager, record.plan)
        log.info(
            "graph %d planned (%s):\n%s",
            record.index,
            ", ".join(f"{stage} {s:.2f} s" for stage, s in record.seconds.items()),
            record.plan,
        )
        record.model = weakref.ref(roots.model) if roots.model is not None else None
        record.manager = weakref.ref(manager) if manager is not None else None
        if manager is not None and params:  # (the latest plan of the model's graphs decides)
            manager.n_clip_overlap = record.plan.n_clip_overlap
            manager.note_read_by_graph(params, record.key)
        if roots.model is not None and params and not self.explain:
            _warn_if_reshaped(roots.model, record, self.example_inputs)
            roots.model.__dict__.setdefault(PLANS_ATTR, []).append((len(params), record.plan))
        return manager

    def _rewrite(self, joint, joint_inputs, kwargs, graphs, roots: FrameRoots, manager, device: torch.device, dumper):
        """The plan carried out (passes/): the joint passes and the partition again where blocks are recomputed,
        then the forward and backward passes, with the swap space and step monitor they use; (forward, backward).
        `graphs`: the forward and backward as first partitioned."""
        record, config = self.record, self.config
        fw, bw = graphs
        ctx = PassContext(
            config=config,
            plan=record.plan,
            record=record,
            dumper=dumper,
            manager=manager,
            example_inputs=self.example_inputs,
        )
        joint = run_passes(joint, ctx, JOINT_PASSES, stage="joint")
        if any(must_recompute(n) for n in joint.graph.nodes):  # recompute tags change the partition: cut again
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        saved = frozenset(n.name for n in bw.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents"))
        swap = None
        if "swap" in record.plan.block_modes:
            limits = (record.plan.predicted_peak_bytes, config.gpu_memory_bytes, device_capacity(device))
            budget = min((limit for limit in limits if limit), default=None)  # prefetch within the tightest
            swap = SwapSpace(device, budget_bytes=budget, upload_stream=manager.upload_stream if manager else None)
        monitor = self._monitor(roots, manager, device, dumper)
        for runtime_object in (swap, monitor):  # the ops reach them by weak handle: the model keeps them alive
            if runtime_object is not None:
                roots.model.__dict__.setdefault(RUNTIME_ATTR, []).append(runtime_object)
        if manager is not None and record.grad_source is None:  # (kept by a re-plan, which compiles outside Dynamo)
            # the frame and the modules its locals are: recompiles for other input shapes share it (one of them
            # runs), those for other modules running the same code (one graph per layer) do not
            compile_id = torch._guards.CompileContext.current_compile_id()
            frame = compile_id.frame_id if compile_id is not None else ("graph", record.index)
            record.grad_source = manager.grad_source((frame, tuple(sorted(roots.paths.values()))))
        ctx = dataclasses.replace(ctx, saved=saved, swap=swap, monitor=monitor, grad_source=record.grad_source or 0)
        fw = run_passes(fw, ctx, GRAPH_PASSES, stage="forward")
        output = next(n for n in fw.graph.nodes if n.op == "output")
        ctx = dataclasses.replace(
            ctx,
            forward_placeholders=[n for n in fw.graph.nodes if n.op == "placeholder"],
            forward_outputs=[a for a in output.args[0] if isinstance(a, fx.Node)],
        )
        bw = run_passes(bw, ctx, GRAPH_PASSES, stage="backward")
        if swap is not None:
            outs = sorted(
                fw.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default),
                key=lambda n: n.args[1],
            )
            with real_tensors():  # the partitioner runs under AOTAutograd's fake mode
                swap.allocate([n.meta["val"] for n in outs])
            record.swap = swap
        if manager is not None:
            for node in bw.graph.find_nodes(op="call_function", target=torch.ops.protrain.reduce_grads.default):
                manager.expect_gradients(node.args[1], node.args[2])
        return fw, bw

    def _monitor(self, roots: FrameRoots, manager, device: torch.device, dumper) -> StepMonitor | None:
        """The step monitor of a model's graph that is dumped, or that the closed loop will re-plan (a graph of no
        model, a loss after a graph break, has nothing to keep it alive: none there)."""
        record = self.record
        loop = self.guard.loop if self.guard is not None else None
        if not (dumper or (loop is not None and loop.watches(record))) or roots.model is None:
            record.monitor = None
            return None
        hardware = record.costs.hardware if record.costs is not None else None
        retime = (
            functools.partial(retimed, record.costs, record.planning, record.plan)
            if record.costs is not None and record.planning is not None
            else None
        )
        report = REPLANNED_REPORT if loop is not None and loop.switched else REPORT_FILE
        record.monitor = StepMonitor(
            device, record.plan, dumper, manager=manager, hardware=hardware, retime=retime, report_file=report
        )
        return record.monitor

    def _build_chunks(self, model: nn.Module, layout, device: torch.device, bw: fx.GraphModule):
        """The model's ChunkManager for the plan; out of memory, under on_oom="replan", searched again under a
        lower capacity and built again (runtime/oom.py)."""
        replanning = self.guard.replanning if self.guard is not None else Replanning(self.config, device)
        while True:
            try:
                return build_manager(model, layout, self.record.plan)
            except torch.OutOfMemoryError as error:
                state, cause = device_state(device), first_line(error)
            if device.type == "cuda":  # what the partly built chunks had cached
                torch.cuda.empty_cache()
            if not replanning.lower(self.record.capacity):
                record = self.record
                raise replanning.error("chunk building", record.index, record.plan, record.capacity, state, cause)
            self.config = replanning.config
            self.record.plan = self._plan(self.config.plan, layout, device, bw, model, None)

    def _plan(self, forced: dict[str, Any], layout, device: torch.device, bw: fx.GraphModule, model, manager) -> Plan:
        """Search the fields the user did not force, with the cost models of this graph (planner/cost.py)."""
        record, n_block = self.record, self.record.block_map.n_blocks
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
            grad_outputs=frozenset(a.name for a in output.args[0] if isinstance(a, fx.Node)),
            fused=self.config.executor == "inductor",
            hardware=hardware,
        )
        costs = cost_model(record.profile, inputs)  # its swap interval, other bytes and waits settled below
        interval = forced.get("swap_interval") or swap_interval(
            costs.block_saved, costs.block_fwd_s, hardware, uploads_share_link=shared
        )
        # what the profile's baseline held besides activations and the chunk states the model counts itself
        held, waits = 0, False
        if layout is not None:
            graph_params = [self.example_inputs[e.index] for e in record.param_map.values()]
            waits = updates_wait(graph_params)
            if manager is not None:
                # the profile counts the offloaded parameters as held (profiler/on_demand.py); the persistent ones
                # are in their chunks: on the GPU among all the chunk states, on the CPU (whose tracker counts the
                # graph's inputs) the chunks the graph reads
                persistent = [p for p in graph_params if manager.holds(p) and manager.is_persistent(p)]
                held = _nbytes(p for p in graph_params if manager.holds(p) and not manager.is_persistent(p))
                if device.type == "cuda":
                    held += costs.state_bytes(Candidate(manager.n_persist, manager.n_buffer))
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
        loop = self.guard.loop if self.guard is not None else None
        if loop is not None and loop.calibration is not None:  # (a later re-plan, out of memory, as training measured)
            costs = calibrated(costs, loop.calibration)
        record.costs = costs
        start = time.perf_counter()
        host = self.config.host_memory_bytes or host_capacity(device)
        if host is not None and manager is not None and not self.config.host_memory_bytes:
            host += manager.pending_host_bytes  # (the masters of chunks waiting for this plan, which it reuses)
        record.capacity, host = least_on_every_rank(
            [self.config.gpu_memory_bytes or device_capacity(device), host], device
        )
        plan = plan_graph(costs, forced, layout, record.capacity, host, fixed_by=_fixed_by(self.config.plan, manager))
        record.seconds["search"] = time.perf_counter() - start
        record.planning = dataclasses.replace(inputs, capacity_bytes=record.capacity, host_bytes=host)
        return plan


def _fixed_by(options_plan: Mapping[str, Any], manager) -> dict[str, str]:
    """Where each forced plan field came from, for NoPlanFits to say: options['plan'], prepare's plan where the
    chunks wait for their plan, or the chunks already built (whose fields plan_fields_of forces)."""
    origin = {k: "options['plan']" for k in options_plan}
    if manager is None:
        return origin
    if manager.pending_plan is not None:
        return {**{k: "protrain_fx.prepare's plan" for k in manager.pending_plan}, **origin}
    built = "the chunks already built (by protrain_fx.prepare or an earlier graph)"
    return {**origin, **{k: built for k in ("n_persist", "n_buffer", "host_grad_slots", "device_grad_slots")}}


def _regathers(param_map: dict[str, ParamEntry], layout, model) -> tuple[tuple[int, int], ...]:
    """(chunk, block) for each time the forward gathers a chunk again, in or before that block (the last block + 1:
    after it), where a parameter of it is read again after other blocks ran (capture: `read_again_at`). Slots are
    matched by parameter: a tied parameter's name in the graph may be another of its names than the layout's."""
    ident = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)} if model is not None else {}
    chunk_of = {ident.get(s.name, s.name): s.chunk for s in layout.slots}
    found = set()
    for entry in param_map.values():
        chunk = chunk_of.get(ident.get(entry.name, entry.name))
        if chunk is not None:
            found.update((chunk, block) for block in entry.read_again_at)
    return tuple(sorted(found))


def _cost_terms(costs: CostModel, plan: Plan) -> dict[str, Any]:
    """The plan's predicted step split into its terms, and what the models read (costs.json of a dump)."""
    config = Candidate(plan.n_persist, plan.n_buffer, plan.n_swap, plan.n_checkpoint, plan.n_selective)
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


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    return next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _dump_plan(dumper: Dumper, record: GraphRecord, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
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


def _dump(dumper: Dumper, record: GraphRecord) -> None:
    dumper.write_text("forward.py", record.forward.print_readable(print_output=False))
    dumper.write_text("backward.py", record.backward.print_readable(print_output=False))
    dumper.write_json("params.json", {k: v.to_json() for k, v in record.param_map.items()})
    dumper.write_json("blocks.json", record.block_map.to_json())
