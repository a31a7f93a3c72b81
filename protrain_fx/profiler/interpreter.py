"""Profile one training iteration of a partitioned forward and backward graph, node by node, with real tensors.

Nothing here changes a graph: it measures and writes `node.meta["protrain"]` (a `NodeProfile`). Iterations
run at the user's batch size, under `torch.no_grad()` (the graphs already hold the backward) and with the
RNG state restored afterwards, so profiling leaves training bit-for-bit unchanged.

Memory and time come from separate iterations, because reading allocator statistics costs more than a
small kernel takes:
- memory: `ProfilingInterpreter`, an `fx.Interpreter` that reads a memory tracker around every node
  (intra- and inter-op deltas, output bytes, saved-for-backward bytes);
- time: `TimedGraph`, a copy of the graph with a clock mark after every node, run as compiled Python (an
  interpreter adds tens of microseconds per node, more than many kernels take). On CUDA the marks are
  events and a short GPU sleep first lets the CPU queue kernels ahead, so consecutive marks measure the
  GPU time of each node's kernels; on CPU they are `time.perf_counter` readings, taken with one intra-op
  thread (`_one_thread_on_cpu`). Each node keeps its least time over TIMED_RUNS timed iterations: whatever else
  runs on the machine only adds to a node's time, so a slow stretch of one iteration does not reach the profile.
  How far the runs spread above that least is kept as the profile's `timing_noise`, within which the search counts
  step times as equal. On CUDA a probe matmul runs every PROBE_EVERY nodes between two marks of its own: a device
  near its power limit lowers its clocks as a run goes on, so each matmul's time is taken as at the clocks of the
  fastest probe (`least_at_burst_clocks`), and the cost model prices training's clocks from the hardware profile.

The timed graph, its clock and probes are in profiler/timed.py; here the memory run, the iterations and the
profile they make, and the ranks' agreement on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.utils._pytree import tree_leaves

from protrain_fx.capture import BlockMap
from protrain_fx.distributed import rank_and_world_size
from protrain_fx.profiler.fusion import classify, is_matmul
from protrain_fx.profiler.memory import CpuMemoryTracker, CudaMemoryTracker
from protrain_fx.profiler.microbench import probe_matmul
from protrain_fx.profiler.on_demand import CALL_OPS, AbsentCounting, GraphRun, OnDemand, storage_key
from protrain_fx.profiler.profile import GraphProfile, NodeProfile, aggregate_blocks
from protrain_fx.profiler.quiet import wait_until_children_quiet
from protrain_fx.profiler.timed import TimedGraph, new_record
from protrain_fx.progress import progress
from protrain_fx.real_tensors import real_tensors
from protrain_fx.shapes import Sizes, evaluate, symbol_of

log = logging.getLogger(__name__)

TIMED_RUNS = 3  # timed iterations; each node keeps its least time


def _storages(values: Any, dropped: dict[int, int] | None = None) -> dict[int, int]:
    """storage key -> nbytes of the distinct storages behind the tensors in a pytree; `dropped`: the sizes of
    storages held on demand (profiler/on_demand.py), which may hold 0 bytes now."""
    out: dict[int, int] = {}
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = storage_key(t)
            nbytes = t.untyped_storage().nbytes() or (dropped or {}).get(key, 0)
            if nbytes:
                out[key] = nbytes
    return out


# Whether the autograd engine hands AOTAutograd's backward its output gradients (the tangents) in a list it may
# empty, so each is freed after its last use. Older torch passes them as arguments, alive until the backward
# returns: a loss's unused logits get a zero gradient of their full size that stays for the whole backward.
ENGINE_FREES_OUTPUT_GRADS = hasattr(torch.autograd.function.BackwardCFunction, "apply_boxed")


class ProfilingInterpreter(fx.Interpreter):
    """Runs one graph and records the memory behaviour of each node (see the module docstring)."""

    def __init__(
        self, gm: fx.GraphModule, *, graph_kind: str, block_map: BlockMap, tracker, run: GraphRun | None = None
    ):
        super().__init__(gm, garbage_collect_values=True)
        self.tracker = tracker
        self.graph_kind = graph_kind
        self.block_map = block_map
        self.run_hooks = run  # tensors held on demand (profiler/on_demand.py)
        self.records: list[NodeProfile] = []
        self.peak_bytes = 0  # highest allocation seen during the run
        self._after_previous = 0

    def boxed_run(self, args: list[Any]) -> Any:
        if self.run_hooks is not None:
            self.run_hooks.start(args)
        return super().boxed_run(args)

    def run(self, *args, **kwargs):
        self._after_previous = self.tracker.allocated()
        self.tracker.reset_peak()
        out = super().run(*args, **kwargs)
        self.env.clear()  # the interpreter keeps the output node's value; the caller owns it now
        return out

    def run_node(self, node: fx.Node) -> Any:
        if node.op not in CALL_OPS:
            return super().run_node(node)
        i = len(self.records)
        record = new_record(node, self.graph_kind, self.block_map)
        self.records.append(record)
        tracker = self.tracker
        peak = tracker.peak()
        record.inter_delta_bytes = max(0, peak - self._after_previous)
        self.peak_bytes = max(self.peak_bytes, peak)
        if self.run_hooks is not None:  # what it fetches is counted already (as absent)
            self.run_hooks.before(i, self.env)
        record.allocated_before = before = tracker.allocated()
        tracker.reset_peak()
        inputs = _storages([self.env[n] for n in node.all_input_nodes if n in self.env])
        out = super().run_node(node)
        peak = tracker.peak()
        record.intra_delta_bytes = max(0, peak - before)
        self.peak_bytes = max(self.peak_bytes, peak)
        record.output_bytes = sum(b for p, b in _storages(out).items() if p not in inputs)
        if self.run_hooks is not None:
            self.run_hooks.after(i, out)
        self._after_previous = tracker.allocated()
        tracker.reset_peak()
        return out


def _tangent(node: fx.Node, sizes: Sizes) -> torch.Tensor | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return torch.ones([evaluate(d, sizes) for d in val.shape], dtype=val.dtype, device=val.device)


def _sizes(fw: fx.GraphModule, primals: Sequence[Any]) -> dict:
    """The value of each symbol of a graph with symbolic sizes in this run: its size inputs' values."""
    placeholders = fw.graph.find_nodes(op="placeholder")
    return {s: int(x) for n, x in zip(placeholders, primals) if (s := symbol_of(n.meta.get("val"))) is not None}


def profile_iteration(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    primals: Sequence[Any],
    block_map: BlockMap,
    on_demand: OnDemand | None = None,
) -> GraphProfile:
    """Run `fw` then `bw` on `primals` (the graph's real inputs) and return the GraphProfile.

    With `on_demand` (profiler/on_demand.py) parameters, saved activations and gradients are held only while
    used, and memory is reported as if they were held throughout: for a model or batch larger than the GPU.

    Memory and time are measured in separate iterations (see the module docstring); on CUDA an untimed
    iteration runs first, so first-use costs (kernel loading, library handles and workspaces) stay out of
    the measurement as they stay out of every later training step. Each node's NodeProfile is also written
    into `node.meta["protrain"]` of `fw` and `bw`.
    """
    device = next((t.device for t in primals if isinstance(t, torch.Tensor) and t.device.type != "cpu"), None)
    device = device or torch.device("cpu")
    timed_graphs: dict[str, TimedGraph] = {}  # built once (thousands of nodes to generate code for), run each time

    def iteration(tracker) -> tuple[list[NodeProfile], int, int, int]:
        return _iteration(fw, bw, primals, block_map, device, tracker, on_demand, timed_graphs)

    n_nodes = len(fw.graph.nodes) + len(bw.graph.nodes)
    runs = TIMED_RUNS + (2 if device.type == "cuda" else 1)
    bar = progress(total=runs, desc=f"profiling {n_nodes} nodes", unit="run")
    memory = _memory_run(iteration, device, on_demand, bar)
    nodes = memory.nodes
    if device.type == "cuda":  # (inductor's compile workers start as the compile begins: profiler/quiet.py)
        wait_until_children_quiet()
    latencies, probes = _timed_runs(iteration, nodes, device, timed_graphs, bar)
    bar.close()
    clock_stretch, noise = least_at_burst_clocks(nodes, latencies, probes)
    _annotate(nodes, fw, bw, primals, block_map, device)
    profile = GraphProfile(
        device=str(device),
        forward_s=sum(r.latency_s for r in nodes if r.graph == "forward"),
        backward_s=sum(r.latency_s for r in nodes if r.graph == "backward"),
        peak_bytes=memory.peak,
        baseline_bytes=memory.baseline,
        saved_bytes=memory.saved_bytes,
        nodes=nodes,
        blocks=aggregate_blocks(nodes),
        reserved_bytes=memory.reserved,
        measured_peak_bytes=memory.measured_peak,
        matmul_clock_stretch=clock_stretch,
        timing_noise=noise,
    )
    log.info(
        "profiled %d nodes on %s: forward %.2f ms, backward %.2f ms (timing noise %.1f%%), peak %.1f MiB, saved "
        "activations %.1f MiB",
        len(nodes),
        device,
        profile.forward_s * 1e3,
        profile.backward_s * 1e3,
        noise * 100,
        memory.peak / 2**20,
        memory.saved_bytes / 2**20,
    )
    return profile


# `_iteration` of one pair of graphs, given its memory tracker (None: timed): (node records, baseline, peak, saved bytes)
_Iteration = Callable[[Any], tuple[list[NodeProfile], int, int, int]]


@dataclasses.dataclass(frozen=True)
class _MemoryRun:
    """What the memory iteration measured (`_memory_run`)."""

    nodes: list[NodeProfile]
    baseline: int  # bytes allocated at the start
    peak: int
    saved_bytes: int  # activation bytes the forward saves for the backward
    reserved: int  # the allocator's reserved bytes after it (0 on the CPU)
    measured_peak: int  # the peak it held (on demand: less than `peak`, which counts what it dropped)


def _memory_run(iteration: _Iteration, device: torch.device, on_demand: OnDemand | None, bar) -> _MemoryRun:
    """The memory iteration, after an untimed one on CUDA (`iteration(tracker)`: `_iteration` of the graphs, see
    `profile_iteration`)."""
    if device.type == "cuda":
        # blocks cached before (the hardware profile's, ...) would take what the first run leaves allocated and
        # then could not be freed: the fragmentation below would count them
        torch.cuda.empty_cache()
        # on demand, what to drop and fetch is learned here for the timed run
        iteration(AbsentCounting(CudaMemoryTracker(device), on_demand) if on_demand is not None else None)
        bar.update()
        # so that the reserved bytes read after the memory run, over its peak, are the fragmentation of that run
        torch.cuda.empty_cache()
    tracker = CudaMemoryTracker(device) if device.type == "cuda" else CpuMemoryTracker()
    if on_demand is not None:
        tracker = AbsentCounting(tracker, on_demand)
    nodes, baseline, peak, saved_bytes = iteration(tracker)
    bar.update()
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    measured_peak = tracker.measured_peak if on_demand is not None else peak
    return _MemoryRun(nodes, baseline, peak, saved_bytes, reserved, measured_peak)


def _timed_runs(
    iteration: _Iteration, nodes: list[NodeProfile], device: torch.device, timed_graphs: dict[str, TimedGraph], bar
) -> tuple[list[list[float]], list[list[float]]]:
    """TIMED_RUNS timed iterations (`iteration(None)`, by the TimedGraphs of `timed_graphs`): each node's time in
    each run, and on CUDA the probes' times in each (`least_at_burst_clocks`). `nodes`: the memory run's, which
    every timed run must see alike."""
    latencies: list[list[float]] = []
    probes: list[list[float]] = []
    with _one_thread_on_cpu(device):
        for _ in range(TIMED_RUNS):
            timed, *_ = iteration(None)
            bar.update()
            assert [r.name for r in timed] == [r.name for r in nodes], "timing and memory runs saw different nodes"
            latencies.append([t.latency_s for t in timed])
            if device.type == "cuda":
                probes.append([t for kind in ("forward", "backward") for t in timed_graphs[kind].probe_at_records()])
    return latencies, probes


def _annotate(
    nodes: list[NodeProfile],
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    primals: Sequence[Any],
    block_map: BlockMap,
    device: torch.device,
) -> None:
    """Complete the node records with what the graphs tell of them (the highest block whose backward reads a saved
    value, fusion.py's classes) and write each into its node's `meta["protrain"]`."""
    needed_from = block_map.needed_from(bw.graph)
    for record in nodes:
        if record.graph == "forward" and record.saved_bytes:
            record.needed_from_block = needed_from.get(record.name)
    sizes = _sizes(fw, primals)
    for kind, gm in {"forward": fw, "backward": bw}.items():
        named = {r.name: r for r in nodes if r.graph == kind}
        classify(named, gm.graph, cpu=device.type == "cpu", sizes=sizes)
        for node in gm.graph.nodes:
            if node.name in named:
                node.meta["protrain"] = named[node.name]


def least_at_burst_clocks(
    nodes: list[NodeProfile], latencies: list[list[float]], probes: list[list[float]]
) -> tuple[float, float]:
    """Set each node's latency_s to its least over the timed runs (`latencies`, per run and node), matmuls'
    (`is_matmul`) each as at the clocks of a short burst: times the least probe time over the runs, over the
    probe time where it ran (`probes`, per run and node; none on the CPU). A device near its power limit lowers
    its clocks as a run goes on, and how far differs from run to run and machine to machine; the cost model
    prices the clocks of training from the hardware profile (`HardwareProfile.sustained_matmul_stretch`). Returns
    the matmuls' least time as run over their time at burst clocks (1 on the CPU), and the timing noise: the nodes'
    median time over the runs (as at burst clocks), summed, over their least, summed, less one."""
    burst = min((t for run in probes for t in run if t > 0), default=0.0)
    as_run, at_burst, median = 0.0, 0.0, 0.0
    for i, record in enumerate(nodes):
        matmul = bool(probes) and is_matmul(record.target)
        times = [run[i] * (burst / probes[r][i] if matmul else 1.0) for r, run in enumerate(latencies)]
        record.latency_s = min(times)
        median += statistics.median(times)
        if matmul:
            as_run += min(run[i] for run in latencies)
            at_burst += record.latency_s
    least = sum(record.latency_s for record in nodes)
    noise = median / least - 1 if least > 0 else 0.0
    return (as_run / at_burst if at_burst > 0 else 1.0), noise


@contextlib.contextmanager
def _one_thread_on_cpu(device: torch.device):
    """On the CPU, time with one intra-op thread: an op split over several threads ends when the last of them
    does, and where other processes use the cores, one of them waits a scheduler slice to run, which can take
    many times the op's own time (docs/design.md, "The cost models and the search")."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _iteration(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    primals: Sequence[Any],
    block_map: BlockMap,
    device: torch.device,
    tracker,
    on_demand: OnDemand | None,
    timed_graphs: dict[str, TimedGraph],
) -> tuple[list[NodeProfile], int, int, int]:
    """One forward + backward run; returns (node records, bytes allocated at the start, peak bytes, saved
    activation bytes); the byte counts are 0 without a tracker. Without one the graphs are timed, by the
    TimedGraphs of `timed_graphs` (graph kind -> TimedGraph), built there the first time.

    Arguments are passed boxed (the list is cleared), so each input is freed after its last use, as in
    AOTAutograd's own runtime; the backward's output gradients are held to its end where the autograd engine
    holds them (ENGINE_FREES_OUTPUT_GRADS).
    """
    fw_out_node = next(n for n in fw.graph.nodes if n.op == "output")
    fw_outputs = [n for n in tree_leaves(fw_out_node.args[0]) if isinstance(n, fx.Node)]
    bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    saved_names = {n.name for n in bw_placeholders if not n.name.startswith("tangents")}
    n_saved = len([n for n in bw_placeholders if n.name in saved_names])
    # held on demand: the forward's saved values after their last forward use, the backward's gradients
    fw_drop = frozenset(n.name for n in fw_outputs[len(fw_outputs) - n_saved :])
    bw_out_node = next(n for n in bw.graph.nodes if n.op == "output")
    bw_drop = frozenset(n.name for n in tree_leaves(bw_out_node.args[0]) if isinstance(n, fx.Node))
    if on_demand is None:
        runs = (None, None)
    elif tracker is None:  # a timed run repeats what the last run learned
        runs = (on_demand.replay(fw), on_demand.replay(bw))
    else:
        runs = (
            on_demand.graph_run(fw, drop=fw_drop, tracker=tracker),
            on_demand.graph_run(bw, drop=bw_drop, tracker=tracker),
        )
    dropped = on_demand.sizes if on_demand is not None else None
    rng_devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    # the partitioner runs under AOTAutograd's fake mode: real tensors need it switched off
    with (
        real_tensors(),
        torch.no_grad(),
        torch.random.fork_rng(devices=rng_devices),
        tracker or contextlib.nullcontext(),
    ):
        baseline = 0
        if tracker:
            tracker.track(t for t in primals if isinstance(t, torch.Tensor))
            baseline = tracker.allocated()
        fw_run = _runner(fw, "forward", block_map, device, tracker, runs[0], timed_graphs)
        outs = fw_run.boxed_run(list(primals))
        values = dict(zip((n.name for n in fw_outputs), tree_leaves(outs)))
        saved_bytes = (
            _mark_saved(fw_run.records, values, saved_names, _storages(list(primals), dropped), dropped)
            if tracker
            else 0
        )
        # the forward returns its outputs, then the saved values in the order of the backward's saved inputs
        # (their names differ once a pass has rewritten them: swap_out nodes, RNG states)
        # (AOTAutograd's forward returns the saved sizes of a graph with symbolic sizes last, its backward takes
        # them first)
        saved_inputs = [n for n in bw_placeholders if n.name in saved_names]
        saved_inputs.sort(key=lambda n: isinstance(n.meta.get("val"), (torch.SymInt, int)))
        leaves = tree_leaves(outs)
        by_input = dict(zip((n.name for n in saved_inputs), leaves[len(leaves) - len(saved_inputs) :]))
        sizes = _sizes(fw, primals)
        bw_args = [by_input[n.name] if n.name in by_input else _tangent(n, sizes) for n in bw_placeholders]
        held = (
            [] if ENGINE_FREES_OUTPUT_GRADS else [a for n, a in zip(bw_placeholders, bw_args) if n.name not in by_input]
        )
        del outs, values, leaves, by_input
        bw_run = _runner(bw, "backward", block_map, device, tracker, runs[1], timed_graphs)
        bw_run.boxed_run(bw_args)
        del held
        if on_demand is not None:
            on_demand.end_iteration()
    peak = max(baseline, fw_run.peak_bytes, bw_run.peak_bytes) if tracker else 0
    return fw_run.records + bw_run.records, baseline, peak, saved_bytes


def _runner(
    gm: fx.GraphModule, graph_kind: str, block_map: BlockMap, device: torch.device, tracker, run, timed_graphs: dict
):
    if tracker is None:
        if graph_kind not in timed_graphs:
            probe = timed_graphs["forward"].probe if "forward" in timed_graphs else None
            if device.type == "cuda" and probe is None:
                probe = probe_matmul(device)
            timed_graphs[graph_kind] = TimedGraph(
                gm, graph_kind=graph_kind, block_map=block_map, device=device, replay=run, probe=probe
            )
        return timed_graphs[graph_kind]
    return ProfilingInterpreter(gm, graph_kind=graph_kind, block_map=block_map, tracker=tracker, run=run)


def _mark_saved(
    records: list[NodeProfile],
    values: dict[str, Any],
    saved_names: set[str],
    input_storages: dict[int, int],
    dropped: dict[int, int] | None = None,
) -> int:
    """Mark forward nodes whose outputs backward reads; each activation storage is counted once, at its first
    saved node. Parameters and inputs kept for backward are not activations and count 0."""
    by_name = {r.name: r for r in records}
    counted: set[int] = set()
    total = 0
    for name in (r.name for r in records):
        if name not in saved_names or name not in values:
            continue
        record = by_name[name]
        record.saved_for_backward = True
        for ptr, nbytes in _storages(values[name], dropped).items():
            if ptr in input_storages or ptr in counted:
                continue
            counted.add(ptr)
            record.saved_bytes += nbytes
            total += nbytes
    return total


def profile_on_every_rank(run, device: torch.device) -> GraphProfile:
    """`run()`'s profile, made the same on every rank so that every rank plans alike: each node's time and
    memory figures are the highest any rank measured. A rank whose profiling fails, or whose graph differs,
    makes every rank raise the same error instead of leaving the others waiting in a collective."""
    failure, profile = None, None
    try:
        profile = run()
    except Exception as e:  # reported on every rank below, then raised here
        failure = e
    _, world_size = rank_and_world_size()
    if world_size == 1:
        if failure is not None:
            raise failure
        return profile
    with real_tensors():  # real tensors for the collectives (the partitioner runs under fake mode)
        return _agreed(profile, failure, world_size, device)


def _agreed(profile: GraphProfile | None, failure, world_size: int, device: torch.device) -> GraphProfile:
    nodes = [] if profile is None else [(n.graph, n.name) for n in profile.nodes]
    reports = [None] * world_size
    dist.all_gather_object(reports, (None if failure is None else f"{type(failure).__name__}: {failure}", nodes))
    errors = [f"rank {r}: {err}" for r, (err, _) in enumerate(reports) if err is not None]
    if errors:
        raise RuntimeError("profiling failed on " + "; ".join(errors)) from failure
    if any(n != reports[0][1] for _, n in reports):
        raise RuntimeError(
            "ranks compiled different graphs (their profiled nodes differ): every rank must run the same model "
            "on inputs of the same shapes"
        )
    fields = ("latency_s", "allocated_before", "intra_delta_bytes", "inter_delta_bytes", "output_bytes", "saved_bytes")
    values = torch.tensor(
        [[float(getattr(n, f)) for f in fields] for n in profile.nodes], dtype=torch.float64, device=device
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    for node, row in zip(profile.nodes, values.tolist()):
        for f, v in zip(fields, row):
            setattr(node, f, v if f == "latency_s" else int(v))
    scalars = torch.tensor(
        [
            profile.peak_bytes,
            profile.baseline_bytes,
            profile.saved_bytes,
            profile.reserved_bytes,
            profile.measured_peak_bytes,
            profile.matmul_clock_stretch,
            profile.timing_noise,
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(scalars, op=dist.ReduceOp.MAX)
    *sizes, clock_stretch, noise = scalars.tolist()
    peak, baseline, saved, reserved, measured = (int(v) for v in sizes)
    return dataclasses.replace(
        profile,
        forward_s=sum(n.latency_s for n in profile.nodes if n.graph == "forward"),
        backward_s=sum(n.latency_s for n in profile.nodes if n.graph == "backward"),
        peak_bytes=peak,
        baseline_bytes=baseline,
        saved_bytes=saved,
        reserved_bytes=reserved,
        measured_peak_bytes=measured,
        matmul_clock_stretch=clock_stretch,
        timing_noise=noise,
        blocks=aggregate_blocks(profile.nodes),
    )
