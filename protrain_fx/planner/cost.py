"""The cost models (paper §4.3, Appendix A): step time and peak GPU memory of any configuration, from one profile
of the graph (profiler/) and the hardware profile, without running it.

    model = CostModel.build(profile, hardware, n_block=..., layout=..., ...)
    model.step_s(Candidate(n_persist=4, n_buffer=2, n_swap=1, n_checkpoint=6, n_selective=8))
    model.peak_bytes(Candidate(...))

Compute times are the profiled node times; under inductor (`fused`) the nodes it fuses cost the bytes their
fused kernels move at the device's memory bandwidth instead (`node_s`, profiler/fusion.py).

Runtime (Appendix A.1). The paper's T_iter = T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim), refined for when the
host's AdamW can run: T_iter = T_fwd + T_bwd + T_gpu_optim + the next forward's wait for the host, where the host
steps each offloaded chunk once its gradient has been reduced and copied down (one at a time, the lowest landed
chunk first, as host_queue.py does) and the next forward waits where it would load a chunk the host has
not stepped yet. The host's AdamW is slower while copies run over the link (they share the host's memory
bandwidth): its rate at each moment is the one measured beside copies running the same ways (`HostRates`).
T_gpu_optim is what the persistent chunks' device AdamW adds: each runs once its gradient is reduced, beside the
rest of the backward, where it adds only the part of its time that the backward's kernels do not hide (the
hardware profile measures how much matmuls hide; memory-bound kernels hide none), and all of it after the
backward (`_gpu_optim_s`); with gradient clipping they wait for `AdamW.step()` and add all of it. Where every
update waits for `AdamW.step()` (an optimizer that skips steps with an inf or NaN gradient: float16's loss
scaling), every step is timed as a clipped one none of whose offloaded chunks update during the backward.
With gradient clipping each host update either waits for the end of the backward, or runs as usual while also
copying aside what it changes (to undo it if the clip applies): `phases(config, clipped=...)`. The paper sums the
forward and backward per chunk as max(compute, communication); the runtime's copies do not keep to chunk windows
(its graphs reach a chunk's gather ahead of the device, so an upload starts as soon as a buffer frees), so here
each is laid out chunk by chunk on three lanes, the compute and the link's two ways:
  forward: a non-persistent chunk's upload (shard up, then the all-gather) starts once the link to the device is
    free and a buffer is (the chunk loaded n_buffer before it has been computed), and once the host has stepped
    it; a chunk computes once it is loaded and the chunk before is done, and is done no sooner than the swap-out
    copies beside it (a swapped block's are spread over the swap_interval blocks after it, its settle point), nor
    than the uploads of the chunks gathered again beside it (`regathers`: a chunk the forward reads again after
    other chunks, a tied embedding by the head, is released between, passes/chunks.py);
  backward (last chunk first): the last n_buffer non-persistent chunks are still in their buffers; the others
    upload as in the forward; a chunk computes and recomputes its checkpointed blocks (the whole forward) and
    its selective blocks (their marked ops: planner/selective.py), and is done no sooner than
    the swap-in copies beside it (prefetched swap_interval blocks ahead, behind the uploads queued so far); then
    its gradient is reduced, and an offloaded chunk's shard copied to the host: these copies run one at a time
    on their own stream beside the compute, and the host's AdamW of a chunk starts when its copy ends; an
    offloaded chunk reduces in one of REDUCE_BUFFERS buffers (runtime/chunks/reduce.py), so its reduce waits for the
    copy of the chunk that used that buffer before;
  a chunk gathered again at the forward's end is in fact one of the backward's buffered ones, and the one it
    displaced is uploaded: as many uploads;
  with one buffer a chunk's load cannot overlap the compute of the chunk before it (one buffer, in use).
Each copy runs at the rate measured beside what runs where it starts: copies the other way, the host's AdamW
(which slows copies to the device), both or neither (`_Link`, from an earlier pass of the
timelines). On the CPU (no overlap) everything runs in line.
A node's compute belongs to the chunk of its block (pre-block nodes, and those between two block lists, to the
first chunk; post-block ones to the last). Without a chunk layout the step is the profiled compute plus recompute.

Peak memory (Appendix A.2). The profile ran with every block unoptimized and every parameter on the device.
Per node, `allocated_before + max(intra, inter, 0)` less the baseline (what was allocated before the forward)
is its activation peak there; the configuration's peak is the highest of those, each less the activations the
configuration does not hold at that point, plus the model states the configuration keeps on the device and
whatever else the baseline held (under inductor less the tensors its fused kernels never allocate,
`unfused_bytes` of profiler/fusion.py); that is the allocated peak, and times α what the allocator reserves (what
must fit the GPU):
  checkpointed block b: its saved bytes but its output (the next block's input stays saved) are gone in the
    forward after b and in the backward until b is reached, where recompute brings them back along with
    b's forward transient;
  selective block b: likewise its saved bytes but those it keeps (planner/selective.py), with its recomputed ops'
    transient;
  swapped block b: its saved bytes are gone from swap_interval blocks after b (runtime/swap.py's settle point)
    until the backward reaches b (prefetches beyond that run only within the budget, so add no peak);
  states: persistent chunks (parameters, master, AdamW's two states, and their gradients: one each, or
    `device_grad_slots` shared), chunk buffers, the landing shard and the reduce buffers of offloaded chunks,
    all but the parameters and buffers in the master dtype (fp32, or the parameters', which then need no
    master: the plan's `master_dtype`); with chunks the gradients the profile kept are taken out too (the
    runtime reduces them away per chunk).
α is measured: the allocator's reserved over allocated peak in the profiling run (1 on the CPU).

swap_interval: how many blocks of forward compute it takes to hide one block's swap-out copy,
    N_interval = ceil(max over blocks of (bytes the block saves / device-to-host bandwidth) / block forward time)
It is fixed before the search (paper line 231).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Sequence

from protrain_fx.planner.chunking import ChunkLayout
from protrain_fx.planner.plan import HOST_STATES, MIN_GRAD_SLOTS, REDUCE_BUFFERS, interleaved_modes
from protrain_fx.planner.selective import selective_terms
from protrain_fx.profiler.fusion import EXTERN, is_matmul
from protrain_fx.profiler.hardware import HardwareProfile
from protrain_fx.profiler.profile import GraphProfile, NodeProfile

ADAM_STATES = 2  # exp_avg and exp_avg_sq, each of the master dtype, per parameter element


class HostRates:
    """The host AdamW's seconds per parameter over time, set by which copies run then (`h2d`, `d2h`: their
    (start, end) seconds); they share the host's memory bandwidth with it (HardwareProfile.host_adam_s)."""

    def __init__(
        self,
        hardware: HardwareProfile,
        h2d: list[tuple[float, float]],
        d2h: list[tuple[float, float]],
        master_bytes: int = 4,
    ):
        events = sorted(
            (t, delta, way)
            for way, spans in enumerate((h2d, d2h))
            for a, b in spans
            if b > a
            for t, delta in ((a, 1), (b, -1))
        )
        self.starts, self.rates, running = [-math.inf], [hardware.host_adam_s(False, False, master_bytes)], [0, 0]
        for t, delta, way in events:
            running[way] += delta
            rate = hardware.host_adam_s(running[0] > 0, running[1] > 0, master_bytes)
            if t == self.starts[-1]:
                self.rates[-1] = rate
            else:
                self.starts.append(t)
                self.rates.append(rate)

    def end(self, start: float, params: float) -> float:
        """When the AdamW of `params` parameters begun at `start` ends."""
        k, t = bisect.bisect_right(self.starts, start) - 1, start
        while True:
            until = self.starts[k + 1] if k + 1 < len(self.starts) else math.inf
            if t + params * self.rates[k] <= until:
                return t + params * self.rates[k]
            params -= (until - t) / self.rates[k]
            t, k = until, k + 1


def _step_clock(forward: dict, backward: dict, next_forward: float) -> dict[str, list[tuple[float, float]]]:
    """The (start, end) spans of the copies of the timelines `forward` and `backward` (`CostModel`), per way,
    on the step's clock: from the backward's start, where the next forward starts at `next_forward`."""
    return {
        way: backward[way] + [(next_forward + a, next_forward + b) for a, b in forward[way]] for way in ("h2d", "d2h")
    }


class _Busy:
    """When something runs: the union of (start, end) spans, asked whether it runs at a moment."""

    def __init__(self, spans: Sequence[tuple[float, float]]):
        self.starts: list[float] = []
        self.ends: list[float] = []
        for a, b in sorted(s for s in spans if s[1] > s[0]):
            if self.ends and a <= self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], b)
            else:
                self.starts.append(a)
                self.ends.append(b)

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and t < self.ends[i]


class _Link:
    """Copy times over the host link: each copy runs at the rate measured beside what runs where it starts
    (HardwareProfile.link_bytes_per_s), as an earlier pass of the step's timelines found it: copies the other
    way (`forward`, `backward`: those timelines), the host's AdamW (`host`: its busy spans), both or neither;
    on the step's clock (`_step_clock`). Without an earlier pass every copy runs at the idle rate."""

    def __init__(
        self,
        hardware: HardwareProfile,
        forward: dict | None = None,
        backward: dict | None = None,
        host: Sequence[tuple[float, float]] = (),
        next_forward: float = 0.0,
    ):
        self.hardware, self.host, self.next_forward = hardware, _Busy(host), next_forward
        no_copies = {"h2d": [], "d2h": []}
        spans = _step_clock(forward or no_copies, backward or no_copies, next_forward)
        self.busy = {way: _Busy(spans[way]) for way in spans}

    def seconds(self, way: str, nbytes: float, start: float, *, forward: bool = False) -> float:
        """Seconds to copy `nbytes` to the device (`way` "h2d") or to the host ("d2h"), starting at `start` of the
        backward, or of the next `forward`."""
        if not nbytes:
            return 0.0
        at = start + self.next_forward if forward else start
        other = self.busy["d2h" if way == "h2d" else "h2d"]
        return nbytes / self.hardware.link_bytes_per_s(way, at in other, at in self.host)

    def copy(self, way: str, nbytes: float, start: float, spans: list, *, forward: bool = False) -> float:
        """When a copy begun at `start` ends (as `seconds`), its (start, end) added to a timeline's `spans`."""
        end = start + self.seconds(way, nbytes, start, forward=forward)
        spans.append((start, end))
        return end


def swap_interval(
    block_saved: Sequence[int], block_fwd_s: Sequence[float], hardware: HardwareProfile, *, uploads_share_link: bool
) -> int:
    """The swap interval in blocks (at least 1). `uploads_share_link`: parameter chunks are uploaded during the
    forward, so the copies run at the bandwidth measured with both directions busy."""
    rate = hardware.link_bytes_per_s("d2h", uploads_share_link, False)
    ratios = [saved / rate / seconds for saved, seconds in zip(block_saved, block_fwd_s) if seconds > 0]
    return max(1, math.ceil(max(ratios, default=1.0)))


def node_s(node: NodeProfile, hardware: HardwareProfile) -> float:
    """A node's time under inductor (profiler/fusion.py): a library kernel's as profiled; a fused region's
    bytes at the device's memory bandwidth but at least a kernel launch, on the region's last node; views
    nothing."""
    if node.kernel == EXTERN:
        return node.latency_s
    if not node.fused_bytes:
        return 0.0
    return max(node.fused_bytes / hardware.device_bytes_per_s, hardware.kernel_s)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """The searched fields of a plan (paper: n_persist, n_buffer, n_swap, n_checkpoint; and n_selective)."""

    n_persist: int = 0
    n_buffer: int = 0
    n_swap: int = 0
    n_checkpoint: int = 0
    n_selective: int = 0


@dataclasses.dataclass(frozen=True)
class ModeTerms:
    """What a configuration's costs read of its block modes alone (`CostModel.mode_terms`). The search's
    configurations share few block layouts, so it computes these once per layout and hands them to the methods
    that take `terms`."""

    activation_peak: int  # `CostModel.activation_peak` of its modes
    recompute_s: float  # seconds its blocks recompute in the backward
    swapped_bytes: int  # bytes its swapped blocks keep on the host
    per_chunk: dict[str, list[float]] | None  # `CostModel._per_chunk` (None without chunks)


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of profiled nodes of one graph and one place: a block (0..n_block-1), or -1 before the blocks and
    n_block after them. `peak` is the highest per-node peak in it, as profiled."""

    graph: str
    place: int
    peak: int


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What the cost formulas read about one graph; `build` derives it from the profiles and the chunk layout."""

    n_block: int
    swap_interval: int
    block_fwd_s: tuple[float, ...]
    block_bwd_s: tuple[float, ...]
    block_saved: tuple[int, ...]  # activation bytes each block keeps for the backward
    block_output: tuple[int, ...]  # bytes of the block's output (a checkpointed block's neighbour keeps it)
    block_transient: tuple[int, ...]  # highest intra-op spike of the block's forward (recompute brings it back)
    other_fwd_s: tuple[float, float]  # forward compute before and after the blocks
    other_bwd_s: tuple[float, float]
    segments: tuple[Segment, ...]  # peaks above the profile's baseline
    hardware: HardwareProfile
    alpha: float = 1.0
    other_bytes: int = 0
    # the chunk layout (n_chunk 0: parameters are not in chunks and stay where they are)
    n_chunk: int = 0
    chunk_elems: int = 0
    shard_elems: int = 0
    element_size: int = 2
    world_size: int = 1
    block_chunk: tuple[int, ...] = ()  # chunk holding each block's parameters
    chunk_params: tuple[int, ...] = ()  # parameter elements in each chunk (padding excluded)
    # (chunk, the chunk beside whose forward compute it is gathered again): a chunk the forward reads again after
    # other chunks (a tied embedding read by the head), where it is not persistent
    regathers: tuple[tuple[int, int], ...] = ()
    forced_modes: tuple[str, ...] = ()  # the user's block_modes, in place of the interleaved layout
    overlap: bool = True  # copies and host work run beside the compute (False on the CPU: the same cores do all)
    host_budget: int | None = None  # the host memory this rank has for offloaded chunks and swap (None: not budgeted)
    grad_slots_held: int | None = None  # the user's host_grad_slots (at most one per offloaded chunk is used)
    device_grad_slots_held: int | None = None  # the user's device_grad_slots (at most one per persistent chunk)
    # the persistent chunks share MIN_GRAD_SLOTS gradient buffers (the search's last resort, planner/search.py)
    share_device_grads: bool = False
    timing_noise: float = 0.0  # the profile's (GraphProfile.timing_noise): the search ties step times within it
    master_bytes: int = 4  # bytes per element of masters, gradients and AdamW states (the plan's master_dtype)
    backward_matmul_share: float = 0.0  # of the backward's compute time, the share in matmuls (fusion.is_matmul)
    # the matmuls' time in training over their time at burst clocks, as profiled (`build`; 1: not measured)
    matmul_stretch: float = 1.0
    # every update waits for `AdamW.step()`, as where non-finite gradients skip the step (loss scaling, by default
    # with float16; runtime/chunks/updates.py `defer_updates`): every step is timed as a clipped one none of whose
    # offloaded chunks update during the backward
    updates_wait: bool = False
    # a selective block (planner/selective.py): the bytes it keeps for the backward, the seconds of its recompute
    # and the spike of it; empty: the mode is not priced (a profile without the marks), and never searched
    block_kept: tuple[int, ...] = ()
    block_selective_s: tuple[float, ...] = ()
    block_selective_transient: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        profile: GraphProfile,
        hardware: HardwareProfile,
        *,
        n_block: int,
        swap_interval: int = 1,
        layout: ChunkLayout | None = None,
        block_of_param: Sequence[int | None] = (),
        regathers: Sequence[tuple[int, int]] = (),
        other_bytes: int = 0,
        grad_outputs: frozenset[str] = frozenset(),
        fused: bool = False,
        master_bytes: int = 4,
    ) -> CostModel:
        """The model of one graph. `block_of_param`: the block of each of the layout's slots (None outside blocks);
        `regathers`: (chunk, block) for each time the forward gathers a chunk again, in or before that block (the
        last block + 1: after the blocks), as backend.py's `_regathers` finds them;
        `other_bytes`: what the device holds besides the activations and the states `state_bytes` counts (with a
        layout: the profile's baseline less the parameters; without: the whole baseline); `grad_outputs`: names of
        the backward nodes that are parameter gradients (with a layout, the runtime frees each after its chunk's
        reduce); `fused`: the graphs run under a fusing compiler (inductor), see `node_s`; `master_bytes`: the
        plan's master dtype's (planner/plan.py master_bytes)."""
        blocks = {b.block: b for b in profile.blocks}
        fwd, bwd = [0.0] * n_block, [0.0] * n_block
        saved = [blocks[b].saved_bytes if b in blocks else 0 for b in range(n_block)]
        output, transient = [0] * n_block, [0] * n_block
        other = {("forward", "pre"): 0.0, ("forward", "post"): 0.0, ("backward", "pre"): 0.0, ("backward", "post"): 0.0}
        segments: list[Segment] = []
        grads_held = 0
        backward_s, matmul_s = 0.0, 0.0
        # Where each node is, -1 before the blocks to n_block after them. Forward: the highest block reached so far
        # (the views AOTAutograd adds at the end of the forward, tagged with early blocks, stay after the last
        # block); a node outside the blocks once the last block is entered is after them. Backward: the highest
        # block with nodes still to come (nodes tagged with a lower block that run early, as shared gradients do,
        # do not end the blocks above them); a node outside the blocks sits before that block (n_block at the
        # start), or before the blocks (-1) once none is to come.
        places, highest = [0] * len(profile.nodes), -1
        for i in reversed(range(len(profile.nodes))):
            node = profile.nodes[i]
            if node.graph == "backward":
                if node.block is not None:
                    highest = max(highest, node.block)
                    places[i] = highest
                else:
                    places[i] = highest + 1 if highest >= 0 else -1
        reached = -1
        for i, node in enumerate(profile.nodes):
            if node.graph == "forward":
                if node.block is not None:
                    reached = max(reached, node.block)
                elif reached == n_block - 1:
                    reached = n_block
                places[i] = reached
        # Each node's time as profiled in a short burst; matmuls slower in the sustained workload of training, by
        # the hardware profile's stretch at this graph's share of matmul time (its clocks at the power limit)
        base = [node_s(node, hardware) if fused else node.latency_s for node in profile.nodes]
        bound = [is_matmul(node.target) for node in profile.nodes]
        total_s = sum(base)
        share = sum(s for s, b in zip(base, bound) if b) / total_s if total_s > 0 else 0.0
        stretch = hardware.sustained_matmul_stretch(share)
        selective = selective_terms(profile.nodes, [s * stretch if b else s for s, b in zip(base, bound)], n_block)
        for node, at, seconds, matmul in zip(profile.nodes, places, base, bound):
            seconds *= stretch if matmul else 1.0
            if node.graph == "backward":
                backward_s += seconds
                matmul_s += seconds if matmul else 0.0
            if node.block is None or at != node.block:
                key = (node.graph, "post" if at == n_block else "pre")
                other[key] += seconds
            elif node.graph == "backward":
                bwd[node.block] += seconds
            else:
                fwd[node.block] += seconds
                if node.output_bytes:
                    output[node.block] = node.output_bytes  # the block's last new tensor, in the end
                transient[node.block] = max(transient[node.block], node.intra_delta_bytes)
            spike = max(node.intra_delta_bytes, node.inter_delta_bytes, 0)
            peak = node.allocated_before + spike - profile.baseline_bytes - grads_held
            if fused:  # tensors a fused kernel never allocates
                peak -= node.unfused_bytes
            if layout is not None and node.graph == "backward" and node.name in grad_outputs:
                grads_held += node.output_bytes
            if segments and (segments[-1].graph, segments[-1].place) == (node.graph, at):
                segments[-1] = dataclasses.replace(segments[-1], peak=max(segments[-1].peak, peak))
            else:
                segments.append(Segment(node.graph, at, peak))
        chunks = {}
        if layout is not None:
            block_chunk = [layout.n_chunk - 1] * n_block
            chunk_params = [0] * layout.n_chunk
            for slot, block in zip(layout.slots, block_of_param):
                chunk_params[slot.chunk] += slot.numel
                if block is not None and block < n_block:
                    block_chunk[block] = min(block_chunk[block], slot.chunk)
            chunks = dict(
                n_chunk=layout.n_chunk,
                chunk_elems=layout.chunk_elems,
                shard_elems=layout.shard_elems,
                element_size=layout.element_size,
                world_size=layout.world_size,
                block_chunk=tuple(block_chunk),
                chunk_params=tuple(chunk_params),
                regathers=tuple(
                    (chunk, block_chunk[b] if b < n_block else layout.n_chunk - 1) for chunk, b in regathers
                ),
                master_bytes=master_bytes,
            )
        return cls(
            n_block=n_block,
            swap_interval=swap_interval,
            block_fwd_s=tuple(fwd),
            block_bwd_s=tuple(bwd),
            block_saved=tuple(saved),
            block_output=tuple(output),
            block_transient=tuple(transient),
            other_fwd_s=(other[("forward", "pre")], other[("forward", "post")]),
            other_bwd_s=(other[("backward", "pre")], other[("backward", "post")]),
            segments=tuple(segments),
            hardware=hardware,
            alpha=profile.fragmentation,
            timing_noise=profile.timing_noise,
            overlap=not profile.device.startswith("cpu"),
            other_bytes=other_bytes,
            backward_matmul_share=matmul_s / backward_s if backward_s > 0 else 0.0,
            matmul_stretch=stretch,
            **chunks,
            **(
                dict(
                    block_kept=selective.kept,
                    block_selective_s=selective.recompute_s,
                    block_selective_transient=selective.transient,
                )
                if selective is not None
                else {}
            ),
        )

    # ----- memory ------------------------------------------------------------------------------------

    def modes(self, config: Candidate) -> tuple[str, ...]:
        return self.forced_modes or interleaved_modes(
            self.n_block, config.n_swap, config.n_checkpoint, config.n_selective
        )

    @property
    def prices_selective(self) -> bool:
        """The profile marked what selective blocks keep and recompute (planner/selective.py)."""
        return bool(self.block_kept)

    def saving(self, block: int, mode: str) -> int:
        """Bytes a block in `mode` does not hold between its forward and its backward (a selective one that keeps
        more than the block saved as profiled: less than 0)."""
        if mode == "swap":
            return self.block_saved[block]
        if mode == "checkpoint":
            return max(0, self.block_saved[block] - self.block_output[block])
        if mode == "selective" and self.prices_selective:
            return self.block_saved[block] - self.block_kept[block]
        return 0

    def recompute_transient(self, block: int, mode: str) -> int:
        """The spike of a block's recompute at its backward: a checkpointed block's forward transient, a selective
        one's recomputed ops' (0 for the others)."""
        if mode == "checkpoint":
            return self.block_transient[block]
        if mode == "selective" and self.prices_selective:
            return self.block_selective_transient[block]
        return 0

    def activation_peak(self, modes: Sequence[str]) -> int:
        """The highest activation memory (model states excluded) over the iteration, with these block modes."""
        n = self.n_block
        # bytes gone by each place (-1..n, at index place + 1): in the forward a checkpointed or selective block's
        # from the block after it, a swapped block's from its settle point; in the backward every optimized block's
        # until the backward reaches it
        forward, backward = [0] * (n + 3), [0] * (n + 3)
        for b, mode in enumerate(modes):
            saving = self.saving(b, mode)
            backward[b + 2] += saving
            if mode in ("checkpoint", "selective"):
                forward[b + 2] += saving
            elif mode == "swap":
                forward[min(b + self.swap_interval, n) + 1] += saving
        forward, backward = list(itertools.accumulate(forward)), list(itertools.accumulate(backward))
        peak = 0
        for seg in self.segments:
            if seg.graph == "forward":
                held = seg.peak - forward[seg.place + 1]
            else:
                spike = self.recompute_transient(seg.place, modes[seg.place]) if 0 <= seg.place < n else 0
                held = seg.peak - backward[seg.place + 1] + spike
            peak = max(peak, held)
        return peak

    @property
    def own_master(self) -> bool:
        """The parameters are their own master (a float32 model, or master_dtype "bfloat16"): persistent chunks
        keep no separate master."""
        return self.master_bytes == self.element_size

    def state_bytes(self, config: Candidate) -> int:
        """Device bytes of the model states a chunk configuration keeps (runtime/chunks/storage.py allocates these)."""
        if self.n_chunk == 0:
            return 0
        master = 0 if self.own_master else self.master_bytes
        persistent = config.n_persist * self.chunk_elems * (self.element_size + master)
        persistent += self.device_grad_slots(config) * self.chunk_elems * self.master_bytes
        persistent += sum(self.chunk_params[: config.n_persist]) * ADAM_STATES * self.master_bytes
        buffers = config.n_buffer * self.chunk_elems * self.element_size
        offloaded = self.n_chunk - config.n_persist
        landing = self.shard_elems * self.master_bytes if offloaded and master else 0
        # what gradients are reduced in: an offloaded chunk's always, a persistent one's across several ranks
        buffered = offloaded + (config.n_persist if self.world_size > 1 else 0)
        reduce = min(REDUCE_BUFFERS, buffered) * self.chunk_elems * self.master_bytes
        if self.world_size > 1 and offloaded:  # each buffer's shard the offloaded chunks' gradients are scattered to
            reduce += min(REDUCE_BUFFERS, buffered) * self.shard_elems * self.master_bytes
        return persistent + buffers + landing + reduce

    def host_bytes(self, config: Candidate, grad_slots: int | None = None, terms: ModeTerms | None = None) -> int:
        """Host bytes of this rank the configuration needs (runtime/chunks/: what its host check asks for): per
        offloaded chunk its shard's master and host AdamW states, `grad_slots` gradient shards (default
        `grad_slots(config)`), and the swap space of the swapped blocks' activations (runtime/swap.py)."""
        offloaded = self.n_chunk - config.n_persist
        slots = self.grad_slots(config) if grad_slots is None else grad_slots
        chunks = self.shard_elems * self.master_bytes * (offloaded * HOST_STATES + slots)
        return chunks + (terms or self.mode_terms(config, chunks=False)).swapped_bytes

    def grad_slots(self, config: Candidate) -> int:
        """The host gradient shards the offloaded chunks of `config` get (the user's, if held): one each where
        `host_budget` has room (or is not set), else as many as it has, and no fewer than MIN_GRAD_SLOTS
        (`least_host_bytes`), which they share (runtime/chunks/slots.py)."""
        offloaded = self.n_chunk - config.n_persist
        if self.grad_slots_held is not None:
            return min(offloaded, self.grad_slots_held)
        if self.host_budget is None or not offloaded:
            return offloaded
        room = (self.host_budget - self.host_bytes(config, 0)) // (self.shard_elems * self.master_bytes)
        return max(min(offloaded, MIN_GRAD_SLOTS), min(offloaded, room))

    def device_grad_slots(self, config: Candidate) -> int:
        """The gradient buffers the persistent chunks of `config` get on the device (the user's, if held):
        one each, or MIN_GRAD_SLOTS, which they share (runtime/chunks/slots.py), with `share_device_grads`."""
        if self.device_grad_slots_held is not None:
            return min(config.n_persist, self.device_grad_slots_held)
        if self.share_device_grads:
            return min(config.n_persist, MIN_GRAD_SLOTS)
        return config.n_persist

    def least_host_bytes(self, config: Candidate, terms: ModeTerms | None = None) -> int:
        """The least host memory `config` trains in: its offloaded chunks sharing MIN_GRAD_SLOTS gradient shards."""
        return self.host_bytes(config, min(self.n_chunk - config.n_persist, MIN_GRAD_SLOTS), terms)

    def peak_bytes(self, config: Candidate, terms: ModeTerms | None = None) -> int:
        """The highest allocated bytes of a step (what torch.cuda.max_memory_allocated reports)."""
        activation_peak = terms.activation_peak if terms else self.activation_peak(self.modes(config))
        return activation_peak + self.state_bytes(config) + self.other_bytes

    def mode_terms(self, config: Candidate, *, chunks: bool = True) -> ModeTerms:
        """What `config`'s costs read of its block modes alone; `chunks` False: without the per-chunk split."""
        modes = self.modes(config)
        return ModeTerms(
            activation_peak=self.activation_peak(modes) if chunks else 0,
            recompute_s=sum(self.recompute_s(b, m) for b, m in enumerate(modes)),
            swapped_bytes=sum(self.saving(b, m) for b, m in enumerate(modes) if m == "swap"),
            per_chunk=self._per_chunk(config) if chunks and self.n_chunk else None,
        )

    def reserved_bytes(self, config: Candidate, peak_bytes: int | None = None) -> int:
        """The peak (`peak_bytes` if already known) times α: what the allocator reserves for it, so what must
        fit the GPU."""
        return int((self.peak_bytes(config) if peak_bytes is None else peak_bytes) * self.alpha)

    # ----- time --------------------------------------------------------------------------------------

    def _collective_s(self, op: str) -> float:
        """Seconds of one collective `op` of a chunk across ranks, alone (0 with one rank): the all-gather of its
        parameters, the all-reduce of a persistent chunk's gradient (every rank keeps all of it), the
        reduce-scatter of an offloaded one's to the shards."""
        if self.world_size == 1:
            return 0.0
        size = self.element_size if op == "all_gather" else self.master_bytes
        return self.hardware.collective_s(op, self.chunk_elems * size)

    def _gather_s(self) -> tuple[float, float]:
        """The all-gather of one non-persistent chunk's parameters (after its shard's upload, on the same stream),
        beside the compute: its seconds there, and the seconds it adds to the compute (`_beside_compute`)."""
        return self._beside_compute(self._collective_s("all_gather"))

    def _all_reduce_s(self) -> tuple[float, float]:
        """A persistent chunk's gradient all-reduce across ranks, on its own stream beside the next chunk's
        backward: its seconds there, and the seconds it adds to the compute, with the two passes over the reduce
        buffer the runtime makes on the compute stream once it has landed (the division by the world size in
        place, the copy into the chunk's gradient: each reads and writes the chunk; with one rank the gradient is
        written in place)."""
        if self.world_size == 1:
            return 0.0, 0.0
        lane, slower = self._beside_compute(self._collective_s("all_reduce"))
        nbytes = self.chunk_elems * self.master_bytes
        return lane, slower + 2 * 2 * nbytes / self.hardware.device_bytes_per_s  # (the rate counts reads and writes)

    def _beside_compute(self, seconds: float) -> tuple[float, float]:
        """A collective that takes `seconds` alone, run beside the compute: its time there, and how much later the
        compute ends for it (both share the device's cores and memory bandwidth: the hardware profile's
        `collective_stretch_beside_matmul` and `matmul_delay_beside_collective`)."""
        hw = self.hardware
        beside = seconds * hw.collective_stretch_beside_matmul
        return beside, beside * hw.matmul_delay_beside_collective

    def step_s(self, config: Candidate, clipped: int | None = None) -> float:
        """Predicted seconds per training step (forward, backward and optimizer) of `config`; `clipped`: a step
        with gradient clipping (`phases`)."""
        t = self.phases(config, clipped)
        if not self.overlap:
            return t["forward_s"] + t["backward_s"] + t["gpu_optim_s"] + t["cpu_optim_s"]
        return t["forward_s"] + t["backward_s"] + t["gpu_optim_s"] + t["cpu_optim_wait_s"]

    def host_adam_mean_s(self, config: Candidate) -> float | None:
        """The host AdamW's mean seconds per parameter over the offloaded chunks' updates of a step of `config`,
        at the rates beside the copies the timelines put there: what the step monitor measures in training. None
        where nothing is offloaded."""
        params = sum(self.chunk_params[config.n_persist :]) / self.world_size
        return self.phases(config)["cpu_optim_s"] / params if params else None

    def step_floor_s(
        self,
        config: Candidate,
        terms: ModeTerms | None = None,
        *,
        host_scales: Sequence[float] = (1.0,),
        clip_weight: float = 0.0,
    ) -> float:
        """A lower bound of `step_bound_s(config)`, so of `step_s`, in a few operations (no copy laid out). The
        forward takes no less than its compute, the uploads of the chunks it loads one after another (each at least
        its time alone) and the swap-out copies; the backward no less than its compute (recompute included) and the
        uploads and swap-in copies that share the link to the device; the device's AdamW adds its part not hidden
        (`_gpu_optim_s`). The host's AdamW of the offloaded chunks runs at its fastest rate from the landing of
        the first gradient (the last chunk's backward and its copy) on, and the next forward's upload of the chunk
        last stepped and the last chunk's forward follow it. On the CPU, where nothing overlaps, they all add.
        `host_scales`: the mean of the bounds with the host's work that many times as long
        (`HardwareProfile.host_slower`). `clip_weight`: that share of the bound is one of the step whose clip
        applies, the host as profiled (`step_s(config, clipped=0)`), whose device AdamW adds all its time after
        the backward and whose host AdamW starts only then."""
        if terms is None or (self.n_chunk and terms.per_chunk is None):
            terms = self.mode_terms(config)
        forward = sum(self.other_fwd_s) + sum(self.block_fwd_s)
        backward = sum(self.other_bwd_s) + sum(self.block_bwd_s) + terms.recompute_s
        if self.n_chunk == 0:
            return forward + backward
        hw, per, load, offloaded = self.hardware, terms.per_chunk, self._load_floor_s(), self.n_chunk - config.n_persist
        uploads = (offloaded * load, max(0, offloaded - max(1, config.n_buffer)) * load)
        swapped = (terms.swapped_bytes / hw.d2h_bytes_per_s, terms.swapped_bytes / hw.h2d_bytes_per_s)
        work = sum(self.chunk_params[config.n_persist :]) / self.world_size * self._host_floor_s()
        if not self.overlap:  # (the device's AdamW adds all its time, clipped or not)
            devices = forward + backward + sum(uploads) + sum(swapped) + self._gpu_optim_s(config)
            return devices + work * ((1 - clip_weight) * sum(host_scales) / len(host_scales) + clip_weight)
        forward, backward = max(forward, uploads[0], swapped[0]), max(backward, uploads[1] + swapped[1])
        devices = forward + backward + self._gpu_optim_s(config)
        waits = load + per["forward"][-1]  # (the next forward's, after the host's last update)
        unclipped = devices
        if offloaded:
            first = (
                per["backward"][-1] + per["recompute"][-1] + self.shard_elems * self.master_bytes / hw.d2h_bytes_per_s
            )
            unclipped = sum(max(devices, first + work * s + waits) for s in host_scales) / len(host_scales)
        if not clip_weight:
            return unclipped
        # a step whose clip applies: the host's AdamW starts after the backward and the device's (all of its time)
        clipped = backward + self._gpu_optim_s(config, early=False) + max(forward, work + waits if offloaded else 0.0)
        return (1 - clip_weight) * unclipped + clip_weight * clipped

    def step_bound_s(
        self,
        config: Candidate,
        terms: ModeTerms | None = None,
        *,
        host_scales: Sequence[float] = (1.0,),
        clip_weight: float = 0.0,
    ) -> float:
        """A lower bound of `step_s(config)` at a fraction of its cost: the first pass of the timelines alone
        (every copy at its idle rate, which no copy beats beside other work); and the host's AdamW at its fastest
        rate, each chunk's once its gradient has landed as that pass has it, which the next forward's upload of the
        chunk last stepped and the last chunk's compute follow (on the CPU, where nothing overlaps, it adds).
        `host_scales`: the mean of the bounds with the host's work that many times as long (the first pass does
        not depend on it). `clip_weight`: that share of the bound is one of the step whose clip applies, the host
        as profiled (`step_s(config, clipped=0)`): the device's AdamW adds all its time after the backward (which
        ends no sooner than that pass has it), the host's starts only then, and the next forward's upload of the
        chunk last stepped and the last chunk's compute follow it (on the CPU the host's work adds, as unclipped)."""
        if self.n_chunk == 0:  # (no chunk: nothing waits for a clip)
            return self.step_s(config)
        per = terms.per_chunk if terms is not None and terms.per_chunk is not None else self._per_chunk(config)
        link = _Link(self.hardware)
        forward, backward = self._forward_timeline(config, per, link), self._backward_timeline(config, per, link)
        bound = forward["end"] + backward["end"] + self._gpu_optim_s(config)
        offloaded = range(config.n_persist, self.n_chunk)
        bounds = []
        for scale in host_scales:
            rate = self._host_floor_s() * scale / self.world_size
            if not self.overlap:
                bounds.append(bound + sum(self.chunk_params[c] for c in offloaded) * rate)
                continue
            host = 0.0  # the host's last update ends no sooner than one keeping busy from each gradient's landing
            for c in sorted(offloaded, key=backward["copy_end"].__getitem__):
                host = max(host, backward["copy_end"][c]) + self.chunk_params[c] * rate
            bounds.append(max(bound, host + self._load_floor_s() + per["forward"][-1]) if offloaded else bound)
        unclipped = sum(bounds) / len(bounds)
        if not clip_weight:
            return unclipped
        work = sum(self.chunk_params[c] for c in offloaded) * self._host_floor_s() / self.world_size
        before = backward["end"] + self._gpu_optim_s(config, early=False)
        if not self.overlap:
            clipped = forward["end"] + before + work
        elif offloaded:
            clipped = before + max(forward["end"], work + self._load_floor_s() + per["forward"][-1])
        else:
            clipped = before + forward["end"]
        return (1 - clip_weight) * unclipped + clip_weight * clipped

    def _load_floor_s(self) -> float:
        """The least seconds of an offloaded chunk's load: its shard up at the link's rate alone, the all-gather."""
        return self.shard_elems * self.master_bytes / self.hardware.h2d_bytes_per_s + self._gather_s()[0]

    def _host_floor_s(self) -> float:
        """The host AdamW's least seconds per parameter, beside whichever copies."""
        hw = self.hardware
        return min(hw.host_adam_s(h2d, d2h, self.master_bytes) for h2d in (False, True) for d2h in (False, True))

    def _gpu_optim_s(
        self, config: Candidate, reduced: Sequence[float] | None = None, end: float = 0.0, *, early: bool = True
    ) -> float:
        """What the persistent chunks' AdamW on the device adds to the step. Each starts on the optimizer stream
        once its chunk's gradient is reduced (`reduced`, per chunk: `_backward_timeline`'s copy_end), the last
        chunk first, one at a time (runtime/chunks/ `_step_persistent_early`). Until the backward's compute ends
        (`end`) it runs beside it, `stretch` times as long as alone, and lengthens the backward by its time alone
        times 1 - hidden × matmul share: `hidden`, the share of it that matmuls hide (hardware profile), and the
        matmul share, the backward's time in kernels bound by arithmetic (`is_matmul`; the rest, bound by memory
        as the AdamW is, hides none of it). What is left of it after the backward (all of chunk 0's, reduced as
        the backward ends) adds all its time. `reduced` None: as if each but chunk 0's ran beside the backward (at
        most that is hidden: a lower bound, `step_bound_s`). `early` False (gradient clipping: updates wait for
        `AdamW.step()`) or no overlap (the CPU): every update adds all its time."""
        rate = self.hardware.device_adam_s(self.master_bytes)
        alone = [self.chunk_params[c] * rate for c in range(config.n_persist)]
        if not early or not self.overlap:
            return sum(alone)
        hw = self.hardware
        exposed = 1 - hw.device_adam_hidden_beside_matmul * self.backward_matmul_share
        added, lane = 0.0, 0.0
        for c in reversed(range(config.n_persist)):
            if reduced is None:
                beside = alone[c] if c else 0.0  # (of its time alone, what runs beside the backward)
            else:
                start = max(reduced[c], lane)
                beside = min(alone[c], max(0.0, end - start) / hw.device_adam_stretch_beside_matmul)
                lane = start + beside * hw.device_adam_stretch_beside_matmul + alone[c] - beside
            added += beside * exposed + alone[c] - beside
        return added

    def recompute_s(self, block: int, mode: str) -> float:
        """Seconds a block's backward recomputes: a checkpointed block's forward, a selective one's marked ops."""
        if mode == "checkpoint":
            return self.block_fwd_s[block]
        if mode == "selective" and self.prices_selective:
            return self.block_selective_s[block]
        return 0.0

    def _block_extras(self, config: Candidate) -> tuple[list[float], list[int]]:
        """Per block, the seconds of its recompute (checkpointed, selective) and the bytes it swaps (swapped)."""
        modes = self.modes(config)
        recompute = [self.recompute_s(b, m) for b, m in enumerate(modes)]
        swapped = [self.block_saved[b] if m == "swap" else 0 for b, m in enumerate(modes)]
        return recompute, swapped

    def _per_chunk(self, config: Candidate) -> dict[str, list[float]]:
        """Each chunk's share of the work: seconds of forward and backward compute and of recompute, bytes of the
        swap-out copies (forward) and swap-in copies (backward) that run beside it, and the offloaded chunks the
        forward gathers again beside it (`regathers`)."""
        n = self.n_chunk
        recompute, swapped = self._block_extras(config)
        fwd_c, bwd_c, rec_c, out_c, in_c = ([0.0] * n for _ in range(5))
        again = [sum(1 for chunk, at in self.regathers if at == c and chunk >= config.n_persist) for c in range(n)]
        fwd_c[0] += self.other_fwd_s[0]
        fwd_c[n - 1] += self.other_fwd_s[1]
        bwd_c[0] += self.other_bwd_s[0]
        bwd_c[n - 1] += self.other_bwd_s[1]
        last, k = self.n_block - 1, self.swap_interval
        for b, c in enumerate(self.block_chunk):
            fwd_c[c] += self.block_fwd_s[b]
            bwd_c[c] += self.block_bwd_s[b]
            rec_c[c] += recompute[b]
            # a swapped block's copies run beside the next swap_interval blocks: out after it in the forward (its
            # settle point is k blocks on), in before it in the backward (prefetched k blocks ahead)
            for j in range(1, k + 1):
                out_c[self.block_chunk[min(b + j, last)]] += swapped[b] / k
                in_c[self.block_chunk[min(b + j, last)]] += swapped[b] / k
        return {
            "forward": fwd_c,
            "backward": bwd_c,
            "recompute": rec_c,
            "swap_out": out_c,
            "swap_in": in_c,
            "regather": again,
        }

    def _forward_timeline(
        self, config: Candidate, per: dict[str, list[float]], link: _Link, ready: Sequence[float] | None = None
    ) -> dict:
        """The forward, chunk by chunk, on three lanes: the compute, the copies to the device and those to the
        host. A non-persistent chunk's upload (its shard up, then the all-gather, on one stream) starts once the
        link is free, a buffer is (the chunk loaded n_buffer before it has been computed: the graph reaches its
        gather ahead of the device, so runtime/chunks/gather.py loads as soon as a buffer frees) and, given `ready`
        (per chunk, seconds from the forward's start), once the host has stepped it. A chunk computes once it is
        loaded and the chunk before it is done, and is done no sooner than the swap-out copies beside it (their
        settle waits for them), nor than the chunks gathered again beside it (`regathers`: uploaded as it
        starts, once the link is free; their buffer is not waited for). On the CPU everything runs in line.
        `per`: `_per_chunk(config)`. Returns the end and the copies' (start, end) each way."""
        n, persist, (gather, slower) = self.n_chunk, config.n_persist, self._gather_s()
        shard = self.shard_elems * self.master_bytes  # an offloaded shard's master going up, its gradient down
        t, up, down, h2d, d2h = 0.0, 0.0, 0.0, [], []
        if not self.overlap:
            for c in range(n):
                load = link.seconds("h2d", shard, t, forward=True) + gather if c >= persist else 0.0
                load += per["regather"][c] * (link.seconds("h2d", shard, t, forward=True) + gather)
                t += load + per["forward"][c] + link.seconds("d2h", per["swap_out"][c], t, forward=True)
            return {"end": t, "h2d": h2d, "d2h": d2h}
        buffers, end, loaded, following = max(1, config.n_buffer), [0.0] * n, {}, persist
        for c in range(n):
            gathers = 0  # all-gathers started beside this chunk's compute
            while following < n and following - buffers < max(c, persist):  # a buffer is free for it
                freed = end[following - buffers] if following - buffers >= persist else 0.0
                start = max(up, freed, ready[following] if ready is not None else 0.0)
                up = loaded[following] = link.copy("h2d", shard, start, h2d, forward=True) + gather
                following, gathers = following + 1, gathers + 1
            start = max(t, loaded.get(c, 0.0))
            again = 0.0
            for _ in range(per["regather"][c]):  # a chunk read again (a tied embedding by the head), loaded beside
                again = up = link.copy("h2d", shard, max(up, start), h2d, forward=True) + gather
                gathers += 1
            t = max(start + per["forward"][c] + gathers * slower, again)
            if per["swap_out"][c]:
                down = link.copy("d2h", per["swap_out"][c], max(down, start), d2h, forward=True)
                t = max(t, down)
            end[c] = t
        return {"end": t, "h2d": h2d, "d2h": d2h}

    def _backward_timeline(
        self, config: Candidate, per: dict[str, list[float]], link: _Link, host_ends: list | None = None
    ) -> dict:
        """The backward, chunk by chunk (last to first), on the same three lanes. The last n_buffer non-persistent
        chunks are still in their buffers from the forward; each one before them is uploaded once the link is
        free and a buffer is (the chunk n_buffer before it in this order has been computed). A chunk computes
        (and recomputes its checkpointed blocks) once it is there and the chunk after it is done, and is done no
        sooner than the swap-in copies beside it, which queue behind the uploads (runtime/swap.py). When a
        chunk is done its gradients are reduced; the copies of offloaded shards to the host then run one at a
        time on their own stream, beside the compute (on the CPU, in line); an offloaded chunk's reduce first
        waits for the copy out of the buffer it reuses. Where the offloaded chunks share fewer host gradient
        shards than there are of them (`grad_slots`), the i-th to arrive waits, and the backward with it, until
        i - slots + 1 host updates have ended (`host_ends`, from the host timeline; None: not known yet). Returns
        the end of each chunk's reduce and copy, the backward's compute end, and the copies' (start, end) each
        way."""
        n, persist, (gather, slower) = self.n_chunk, config.n_persist, self._gather_s()
        all_reduce, all_reduce_slower = self._all_reduce_s()
        reduce_scatter, all_reduce_alone = self._collective_s("reduce_scatter"), self._collective_s("all_reduce")
        shard = self.shard_elems * self.master_bytes  # an offloaded shard's master going up, its gradient down
        order = list(reversed(range(persist, n)))  # the non-persistent chunks, in the order the backward needs them
        buffers = max(1, config.n_buffer)
        uploaded = set(order[buffers:])  # (the others are still in their buffers from the forward)
        t, up, copy_end, link_free, end, loaded, following = 0.0, 0.0, [0.0] * n, 0.0, [0.0] * n, {}, buffers
        reduced: list[int] = []  # offloaded chunks in the order they took a reduce buffer
        h2d, d2h = [], []
        slots = self.grad_slots(config) if host_ends is not None else n - persist  # (the bound's first pass: none)
        shared = slots < n - persist
        freed = sorted(e for e in host_ends if e is not None) if shared else []  # when each shard is given back
        beside = 0.0  # what the collectives running beside the next chunk's compute add to it
        for c in reversed(range(n)):
            done = n - 1 - c  # chunks the backward has done so far (the first len(order) are `order`)
            if self.overlap:
                while following < len(order) and following - buffers < done:  # a buffer is free for it
                    start = max(up, end[order[following - buffers]])
                    up = loaded[order[following]] = link.copy("h2d", shard, start, h2d) + gather
                    following, beside = following + 1, beside + slower
                start = max(t, loaded.get(c, 0.0))
                t, beside = start + per["backward"][c] + per["recompute"][c] + beside, 0.0
                if per["swap_in"][c]:
                    up = link.copy("h2d", per["swap_in"][c], max(up, start), h2d)
                    t = max(t, up)
            else:
                load = link.seconds("h2d", shard, t) + gather if c in uploaded else 0.0
                t += load + per["backward"][c] + per["recompute"][c] + link.seconds("h2d", per["swap_in"][c], t)
            end[c] = t
            if c >= persist:
                if len(reduced) >= REDUCE_BUFFERS:  # its buffer's last copy must have ended
                    t = max(t, copy_end[reduced[-REDUCE_BUFFERS]])
                if shared and len(reduced) >= slots:  # a gradient shard on the host must have been given back
                    t = max(t, freed[len(reduced) - slots])
                reduced.append(c)
            if c >= persist:  # a reduce-scatter: the compute stream waits for it (runtime/chunks/reduce.py)
                t += reduce_scatter
                begin = max(t, link_free) if self.overlap else t
            elif self.overlap:  # an all-reduce beside the next chunk's backward
                begin, beside = max(t, link_free) + all_reduce, beside + all_reduce_slower
            else:
                begin = t + all_reduce_alone  # (nothing runs beside it)
            copy = link.seconds("d2h", shard, begin) if c >= persist else 0.0
            copy_end[c] = begin + copy
            if self.overlap:
                link_free = copy_end[c]
            else:
                t = copy_end[c]
            d2h.append((begin, copy_end[c]))
        return {"copy_end": copy_end, "end": t, "h2d": h2d, "d2h": d2h}

    def _host_timeline(
        self, config: Candidate, forward: dict, backward: dict, next_forward: float, clipped: int | None
    ) -> dict:
        """The host steps offloaded chunks one at a time, each once its gradient is there, the lowest landed one
        first (host_queue.py: the next forward needs it first), beside the backward's copies and the next
        forward's (which starts at `next_forward`); its AdamW's rate at each moment is the one measured beside
        the copies then (`HostRates`). With `clipped` only the last `clipped` chunks' updates start as their
        gradient lands, each also copying aside what it changes; the others' wait for the end of the backward
        and the device's updates. Returns when each chunk is stepped (None: not offloaded), the host's busy
        (start, end) spans and their total. Times from the backward's start."""
        hw, n = self.hardware, self.n_chunk
        arrival, work = list(backward["copy_end"]), [1.0] * n  # host work per parameter, in units of its AdamW
        if clipped is not None:
            adam = hw.host_adam_s(False, False, self.master_bytes)
            undo = hw.host_undo_s(self.master_bytes) / adam if adam > 0 else 0.0
            for c in range(config.n_persist, n):
                if c < n - clipped:
                    arrival[c] = max(arrival[c], next_forward)
                else:
                    work[c] += undo
        pending, clock, ends, spans = set(range(config.n_persist, n)), 0.0, [None] * n, []
        if pending:  # (built only where the host has work: the search visits many configurations)
            rates = HostRates(hw, **_step_clock(forward, backward, next_forward), master_bytes=self.master_bytes)
        while pending:
            landed = [c for c in pending if arrival[c] <= clock]
            if not landed:
                clock = min(arrival[c] for c in pending)
                continue
            chunk = min(landed)
            pending.remove(chunk)
            start, clock = clock, rates.end(clock, work[chunk] * self.chunk_params[chunk] / self.world_size)
            ends[chunk] = clock
            spans.append((start, clock))
        return {"ends": ends, "spans": spans, "busy": sum(b - a for a, b in spans)}

    def phases(self, config: Candidate, clipped: int | None = None) -> dict[str, float]:
        """The terms of `step_s`: forward and backward seconds (copies they do not hide included), the optimizer's
        on the device and on the host, and how long the next forward waits for the host's (no optimizer without
        chunks: it is the user's then). The offloaded chunks' host updates start as their gradient lands; with
        `clipped` (a step with gradient clipping, whose last clip did not apply), only the last `clipped` chunks'
        do, each also copying aside what it changes (to undo it if the clip applies: runtime/chunks/updates.py), and the
        others' wait for the end of the backward.

        The timelines are laid out twice: first with every copy at the link's idle rate, then with each at the
        rate beside what the first found running where it starts (copies the other way, the host's AdamW). The
        next forward is laid out once more with each chunk's upload waiting for its host update: the time that
        adds is the wait. Where every update waits for `AdamW.step()` (`updates_wait`), `clipped` is 0 whatever
        is asked."""
        hw = self.hardware
        if self.updates_wait:
            clipped = 0
        if self.n_chunk == 0:
            recompute, swapped = self._block_extras(config)
            hidden = (sum(self.block_fwd_s), sum(self.block_bwd_s)) if self.overlap else (0.0, 0.0)
            return {
                "forward_s": sum(self.other_fwd_s)
                + sum(self.block_fwd_s)
                + max(0.0, sum(swapped) / hw.d2h_bytes_per_s - hidden[0]),
                "backward_s": sum(self.other_bwd_s)
                + sum(self.block_bwd_s)
                + sum(recompute)
                + max(0.0, sum(swapped) / hw.h2d_bytes_per_s - hidden[1]),
                "gpu_optim_s": 0.0,
                "cpu_optim_s": 0.0,
                "cpu_optim_wait_s": 0.0,
            }
        per = self._per_chunk(config)
        link, host = _Link(hw), None
        for _ in range(2):
            forward = self._forward_timeline(config, per, link)
            backward = self._backward_timeline(config, per, link, host["ends"] if host else None)
            gpu_optim = self._gpu_optim_s(config, backward["copy_end"], backward["end"], early=clipped is None)
            next_forward = backward["end"] + gpu_optim
            host = self._host_timeline(config, forward, backward, next_forward, clipped)
            link = _Link(hw, forward, backward, host["spans"], next_forward)
        ready = [0.0 if end is None else end - next_forward for end in host["ends"]]
        waited = self._forward_timeline(config, per, link, ready)
        return {
            "forward_s": forward["end"],
            "backward_s": backward["end"],
            "gpu_optim_s": gpu_optim,
            "cpu_optim_s": host["busy"],
            "cpu_optim_wait_s": max(0.0, waited["end"] - forward["end"]),
        }
