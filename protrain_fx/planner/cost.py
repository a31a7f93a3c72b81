"""The cost models (paper §4.3, Appendix A): step time and peak GPU memory of any configuration, from one profile
of the graph (profiler/) and the hardware profile, without running it.

    model = CostModel.build(profile, hardware, layout=..., family=..., ...)
    model.step_s(Config(n_persist=4, n_buffer=2, n_swap=1, n_checkpoint=6))
    model.peak_bytes(Config(...))

Compute times are the profiled node times; under inductor (`fused`) the nodes it fuses cost the bytes their
fused kernels move at the device's memory bandwidth instead (`node_s`, profiler/fusion.py).

Runtime (Appendix A.1). The paper's T_iter = T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim), refined for when the
host's AdamW can run: T_iter = T_fwd + T_bwd + T_gpu_optim + the next forward's wait for the host, where the host
steps each offloaded chunk once its gradient has been reduced and copied down (one at a time, the lowest landed
chunk first, as runtime/host_queue.py does) and the next forward waits where it would load a chunk the host has
not stepped yet. The host's AdamW is slower while copies run over the link (they share the host's memory
bandwidth): its rate at each moment is the one measured beside copies running the same ways (`_HostRates`).
With gradient clipping each host update either waits for the end of the backward, or runs as usual while also
copying aside what it changes (to undo it if the clip applies): `phases(config, clipped=...)`. The forward and
backward are summed per chunk window as max(compute, communication):
  forward  window i: max(compute of chunk i-1, upload + all-gather of chunk i if not persistent, swap-outs);
  (a swapped block's copies are spread over the swap_interval blocks after it, which they run beside)
  backward window i: max(compute + recompute of chunk i, upload + gather of the chunk the backward needs next
                         unless persistent or still buffered from the forward, swap prefetches);
  at the end of a chunk's backward window its gradient is reduced, and an offloaded chunk's shard copied to the
  host: these copies run one at a time on their own stream beside the compute, and the host's AdamW of a chunk
  starts when its copy ends; an offloaded chunk reduces in one of REDUCE_BUFFERS buffers (runtime/chunks.py),
  so its reduce waits for the copy of the chunk that used that buffer before;
  with one buffer a chunk's load cannot overlap the compute of the chunk before it (one buffer, in use).
A node's compute belongs to the chunk of its block (pre-block nodes to the first chunk, post-block ones to the
last). Without a chunk layout the step is the profiled compute plus recompute.

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
  swapped block b: its saved bytes are gone from swap_interval blocks after b (runtime/swap.py's settle point)
    until the backward reaches b (prefetches beyond that run only within the budget, so add no peak);
  states: persistent chunks (parameters, fp32 master and gradient, AdamW's two states), chunk buffers, the
    landing shard and the fp32 reduce buffers of offloaded chunks; with chunks the gradients the profile kept
    are taken out too (the runtime reduces them away per chunk).
α is measured: the allocator's reserved over allocated peak in the profiling run (1 on the CPU).

swap_interval: how many blocks of forward compute it takes to hide one block's swap-out copy,
    N_interval = ceil(max over blocks of (bytes the block saves / device-to-host bandwidth) / block forward time)
It is fixed before the search (paper line 231).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

from protrain_fx.planner.chunking import ChunkLayout
from protrain_fx.planner.plan import interleaved_modes
from protrain_fx.profiler.fusion import EXTERN
from protrain_fx.profiler.hardware import HardwareProfile
from protrain_fx.profiler.profile import GraphProfile, NodeProfile
from protrain_fx.runtime.chunks import HOST_BYTES_PER_ELEMENT, REDUCE_BUFFERS

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32, per parameter element
GRAD_BYTES = 4  # fp32 gradient per element
MASTER_BYTES = 4  # fp32 master per element (none when the parameters are fp32 themselves)


class _HostRates:
    """The host AdamW's seconds per parameter over time, set by which copies run then (`h2d`, `d2h`: their
    (start, end) seconds); they share the host's memory bandwidth with it (HardwareProfile.host_adam_s)."""

    def __init__(self, hardware: HardwareProfile, h2d: list[tuple[float, float]], d2h: list[tuple[float, float]]):
        events = sorted(
            (t, delta, way)
            for way, spans in enumerate((h2d, d2h))
            for a, b in spans
            if b > a
            for t, delta in ((a, 1), (b, -1))
        )
        self.starts, self.rates, running = [-math.inf], [hardware.host_adam_s(False, False)], [0, 0]
        for t, delta, way in events:
            running[way] += delta
            rate = hardware.host_adam_s(running[0] > 0, running[1] > 0)
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


def swap_interval(
    block_saved: Sequence[int], block_fwd_s: Sequence[float], hardware: HardwareProfile, *, uploads_share_link: bool
) -> int:
    """The swap interval in blocks (at least 1). `uploads_share_link`: parameter chunks are uploaded during the
    forward, so the copies run at the bandwidth measured with both directions busy."""
    rate = hardware.d2h_concurrent_bytes_per_s if uploads_share_link else hardware.d2h_bytes_per_s
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
class Config:
    """The searched fields of a plan (paper: n_persist, n_buffer, n_swap, n_checkpoint)."""

    n_persist: int = 0
    n_buffer: int = 0
    n_swap: int = 0
    n_checkpoint: int = 0


@dataclasses.dataclass(frozen=True)
class _Segment:
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
    segments: tuple[_Segment, ...]  # peaks above the profile's baseline
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
    forced_modes: tuple[str, ...] = ()  # the user's block_modes, in place of the interleaved layout
    overlap: bool = True  # copies and host work run beside the compute (False on the CPU: the same cores do all)

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
        other_bytes: int = 0,
        grad_outputs: frozenset[str] = frozenset(),
        fused: bool = False,
    ) -> CostModel:
        """The model of one graph. `block_of_param`: the block of each of the layout's slots (None outside blocks);
        `other_bytes`: what the device holds besides the activations and the states `state_bytes` counts (with a
        layout: the profile's baseline less the parameters; without: the whole baseline); `grad_outputs`: names of
        the backward nodes that are parameter gradients (with a layout, the runtime frees each after its chunk's
        reduce); `fused`: the graphs run under a fusing compiler (inductor), see `node_s`."""
        blocks = {b.block: b for b in profile.blocks}
        fwd, bwd = [0.0] * n_block, [0.0] * n_block
        saved = [blocks[b].saved_bytes if b in blocks else 0 for b in range(n_block)]
        output, transient = [0] * n_block, [0] * n_block
        other = {("forward", "pre"): 0.0, ("forward", "post"): 0.0, ("backward", "pre"): 0.0, ("backward", "post"): 0.0}
        segments: list[_Segment] = []
        grads_held = 0
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
        for node, at in zip(profile.nodes, places):
            seconds = node_s(node, hardware) if fused else node.latency_s
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
                segments.append(_Segment(node.graph, at, peak))
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
            overlap=not profile.device.startswith("cpu"),
            other_bytes=other_bytes,
            **chunks,
        )

    # ----- memory ------------------------------------------------------------------------------------

    def modes(self, config: Config) -> tuple[str, ...]:
        return self.forced_modes or interleaved_modes(self.n_block, config.n_swap, config.n_checkpoint)

    def saving(self, block: int, mode: str) -> int:
        """Bytes a block in `mode` does not hold between its forward and its backward."""
        if mode == "swap":
            return self.block_saved[block]
        if mode == "checkpoint":
            return max(0, self.block_saved[block] - self.block_output[block])
        return 0

    def activation_peak(self, modes: Sequence[str]) -> int:
        """The highest activation memory (model states excluded) over the iteration, with these block modes."""
        savings = [self.saving(b, m) for b, m in enumerate(modes)]
        peak = 0
        for seg in self.segments:
            if seg.graph == "forward":
                gone = sum(
                    s
                    for b, s in enumerate(savings)
                    if (modes[b] == "checkpoint" and b < seg.place)
                    or (modes[b] == "swap" and min(b + self.swap_interval, self.n_block) <= seg.place)
                )
                extra = 0
            else:
                gone = sum(s for b, s in enumerate(savings) if b < seg.place)
                extra = (
                    self.block_transient[seg.place]
                    if 0 <= seg.place < self.n_block and modes[seg.place] == "checkpoint"
                    else 0
                )
            peak = max(peak, seg.peak - gone + extra)
        return peak

    def state_bytes(self, config: Config) -> int:
        """Device bytes of the model states a chunk configuration keeps (runtime/chunks.py allocates these)."""
        if self.n_chunk == 0:
            return 0
        master = 0 if self.element_size == 4 else MASTER_BYTES
        persistent = config.n_persist * self.chunk_elems * (self.element_size + master + GRAD_BYTES)
        persistent += sum(self.chunk_params[: config.n_persist]) * ADAM_STATE_BYTES
        buffers = config.n_buffer * self.chunk_elems * self.element_size
        offloaded = self.n_chunk - config.n_persist
        landing = self.shard_elems * 4 if offloaded and master else 0
        # what gradients are reduced in: an offloaded chunk's always, a persistent one's across several ranks
        buffered = offloaded + (config.n_persist if self.world_size > 1 else 0)
        reduce = min(REDUCE_BUFFERS, buffered) * self.chunk_elems * 4
        return persistent + buffers + landing + reduce

    def host_bytes(self, config: Config) -> int:
        """Host bytes of this rank the configuration needs: per offloaded chunk its shard's fp32 master, gradient
        and host AdamW states (runtime/chunks.py: HOST_BYTES_PER_ELEMENT, what its host check asks for), and the
        swap space of the swapped blocks' activations (runtime/swap.py)."""
        offloaded = (self.n_chunk - config.n_persist) * self.shard_elems * HOST_BYTES_PER_ELEMENT
        return offloaded + sum(self.saving(b, m) for b, m in enumerate(self.modes(config)) if m == "swap")

    def peak_bytes(self, config: Config) -> int:
        """The highest allocated bytes of a step (what torch.cuda.max_memory_allocated reports)."""
        return self.activation_peak(self.modes(config)) + self.state_bytes(config) + self.other_bytes

    def reserved_bytes(self, config: Config, peak_bytes: int | None = None) -> int:
        """The peak (`peak_bytes` if already known) times α: what the allocator reserves for it, so what must
        fit the GPU."""
        return int((self.peak_bytes(config) if peak_bytes is None else peak_bytes) * self.alpha)

    # ----- time --------------------------------------------------------------------------------------

    def _load_s(self) -> float:
        """Bring one non-persistent chunk to the device: its fp32 master shard up, then the all-gather."""
        hw = self.hardware
        gather = hw.collective_s("all_gather", self.chunk_elems * self.element_size) if self.world_size > 1 else 0.0
        return self.shard_elems * 4 / hw.h2d_bytes_per_s + gather

    def _reduce_s(self, chunk: int, n_persist: int, concurrent: bool) -> tuple[float, float]:
        """Seconds to reduce a chunk's fp32 gradient across ranks (an all-reduce where it is persistent, every rank
        keeping all of it; a reduce-scatter to the shards otherwise) and, offloaded, to copy its shard to the host
        (`concurrent`: while chunk uploads use the link the other way)."""
        hw = self.hardware
        op = "all_reduce" if chunk < n_persist else "reduce_scatter"
        reduce = hw.collective_s(op, self.chunk_elems * 4) if self.world_size > 1 else 0.0
        rate = hw.d2h_concurrent_bytes_per_s if concurrent else hw.d2h_bytes_per_s
        return reduce, (self.shard_elems * 4 / rate if chunk >= n_persist else 0.0)

    def step_s(self, config: Config, clipped: int | None = None) -> float:
        """Predicted seconds per training step (forward, backward and optimizer) of `config`; `clipped`: a step
        with gradient clipping (`phases`)."""
        t = self.phases(config, clipped)
        if not self.overlap:
            return t["forward_s"] + t["backward_s"] + t["gpu_optim_s"] + t["cpu_optim_s"]
        return t["forward_s"] + t["backward_s"] + t["gpu_optim_s"] + t["cpu_optim_wait_s"]

    def _block_extras(self, config: Config) -> tuple[list[float], list[float], list[float]]:
        """Per block, seconds of: its recompute (checkpointed), its swap-out and its swap-in copies (swapped)."""
        modes, hw = self.modes(config), self.hardware
        recompute = [self.block_fwd_s[b] if m == "checkpoint" else 0.0 for b, m in enumerate(modes)]
        swap_out = [self.block_saved[b] / hw.d2h_bytes_per_s if m == "swap" else 0.0 for b, m in enumerate(modes)]
        swap_in = [self.block_saved[b] / hw.h2d_bytes_per_s if m == "swap" else 0.0 for b, m in enumerate(modes)]
        return recompute, swap_out, swap_in

    def _per_chunk(self, config: Config) -> dict[str, list[float]]:
        """Seconds of each chunk's share of the work: forward and backward compute, recompute, swap-out copies
        (forward) and swap-in copies (backward)."""
        n = self.n_chunk
        recompute, swap_out, swap_in = self._block_extras(config)
        fwd_c, bwd_c, rec_c, out_c, in_c = ([0.0] * n for _ in range(5))
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
                out_c[self.block_chunk[min(b + j, last)]] += swap_out[b] / k
                in_c[self.block_chunk[min(b + j, last)]] += swap_in[b] / k
        return {"forward": fwd_c, "backward": bwd_c, "recompute": rec_c, "swap_out": out_c, "swap_in": in_c}

    def _serial(self, config: Config) -> bool:
        """One buffer: a chunk loads only once the previous one is released; on the CPU nothing overlaps."""
        return config.n_buffer == 1 or not self.overlap

    def _backward_timeline(self, config: Config, per: dict[str, list[float]]) -> dict[str, list[float] | float]:
        """The backward, chunk by chunk (last to first): each chunk's window computes it (and recomputes its
        checkpointed blocks) beside the load of the chunk needed next, unless that is persistent or still in a
        buffer from the forward, and its swap-in prefetches. When a chunk's window ends its gradients are
        reduced; the copies of offloaded shards to the host then run one at a time on their own stream, beside
        the compute (on the CPU, in line); an offloaded chunk's reduce first waits for the copy out of the
        buffer it reuses. Returns the end of each chunk's reduce and copy, the backward's compute end, and when
        copies run to the device and to the host ((start, end) each)."""
        n, serial = self.n_chunk, self._serial(config)  # `per`: `_per_chunk(config)`
        load = self._load_s()
        loads = [
            0 <= c - 1 and c - 1 >= config.n_persist and c - 1 < n - config.n_buffer for c in range(n)
        ]  # window c loads chunk c-1
        concurrent = any(loads)
        t, copy_end, link_free = 0.0, [0.0] * n, 0.0
        reduced: list[int] = []  # offloaded chunks in the order they took a reduce buffer
        h2d, d2h = [], []
        for i in reversed(range(-1, n)):
            comp = per["backward"][i] + per["recompute"][i] if i >= 0 else 0.0
            comm = (load if i >= 0 and loads[i] else 0.0) + (per["swap_in"][i] if i >= 0 else 0.0)
            h2d.append((t, t + comm))
            t += comp + comm if serial else max(comp, comm)
            if i < 0:
                continue
            if i >= config.n_persist:
                if len(reduced) >= REDUCE_BUFFERS:  # its buffer's last copy must have ended
                    t = max(t, copy_end[reduced[-REDUCE_BUFFERS]])
                reduced.append(i)
            reduce, copy = self._reduce_s(i, config.n_persist, concurrent)
            if self.overlap:
                copy_end[i] = link_free = max(t, link_free) + reduce + copy
            else:
                t += reduce + copy
                copy_end[i] = t
            d2h.append((copy_end[i] - copy, copy_end[i]))
        return {"copy_end": copy_end, "end": t, "h2d": h2d, "d2h": d2h}

    def phases(self, config: Config, clipped: int | None = None) -> dict[str, float]:
        """The terms of `step_s`: forward and backward seconds (copies they do not hide included), the optimizer's
        on the device and on the host, and how long the next forward waits for the host's (no optimizer without
        chunks: it is the user's then). The offloaded chunks' host updates start as their gradient lands; with
        `clipped` (a step with gradient clipping, whose last clip did not apply), only the last `clipped` chunks'
        do, each also copying aside what it changes (to undo it if the clip applies: runtime/chunks.py), and the
        others' wait for the end of the backward."""
        hw = self.hardware
        if self.n_chunk == 0:
            recompute, swap_out, swap_in = self._block_extras(config)
            hidden = (sum(self.block_fwd_s), sum(self.block_bwd_s)) if self.overlap else (0.0, 0.0)
            return {
                "forward_s": sum(self.other_fwd_s) + sum(self.block_fwd_s) + max(0.0, sum(swap_out) - hidden[0]),
                "backward_s": sum(self.other_bwd_s)
                + sum(self.block_bwd_s)
                + sum(recompute)
                + max(0.0, sum(swap_in) - hidden[1]),
                "gpu_optim_s": 0.0,
                "cpu_optim_s": 0.0,
                "cpu_optim_wait_s": 0.0,
            }
        n, per = self.n_chunk, self._per_chunk(config)
        load, serial = self._load_s(), self._serial(config)
        t_fwd, window_start = 0.0, [0.0] * (n + 1)
        fwd_h2d, fwd_d2h = [], []  # copies of the forward, from its start
        for i in range(n + 1):
            window_start[i] = t_fwd  # window i loads chunk i beside chunk i-1's compute
            comp = per["forward"][i - 1] if i > 0 else 0.0
            comm = load if config.n_persist <= i < n else 0.0
            out = per["swap_out"][i - 1] if i > 0 else 0.0
            fwd_h2d.append((t_fwd, t_fwd + comm))
            fwd_d2h.append((t_fwd, t_fwd + out))
            t_fwd += comp + comm + out if serial else max(comp, comm, out)
        backward = self._backward_timeline(config, per)
        t_bwd, arrival = backward["end"], backward["copy_end"]  # a chunk's gradient is on the host
        gpu_optim = sum(self.chunk_params[: config.n_persist]) * hw.device_adam_s_per_param
        # the host work per parameter updated, in units of its AdamW (sharing the memory bandwidth alike)
        work = [1.0] * n
        if clipped is not None:
            undo = hw.host_undo_s_per_param / hw.host_adam_s_per_param if hw.host_adam_s_per_param > 0 else 0.0
            for c in range(config.n_persist, n):
                if c < n - clipped:  # (after the persistent chunks' device updates, in step())
                    arrival[c] = max(arrival[c], t_bwd + gpu_optim)
                else:
                    work[c] += undo
        # the host steps offloaded chunks one at a time, each once its gradient is there, the lowest landed one
        # first (runtime/host_queue.py: the next forward needs it first), beside the backward's copies and the
        # next forward's (clock: from the backward's start); the next forward loads a chunk only once it is
        # stepped, so it waits where the host has not caught up
        nxt = t_bwd + gpu_optim
        pending, clock, wait, busy = set(range(config.n_persist, n)), 0.0, 0.0, 0.0
        if pending:  # (built only where the host has work: the search visits many configurations)
            rates = _HostRates(
                hw,
                backward["h2d"] + [(nxt + a, nxt + b) for a, b in fwd_h2d],
                backward["d2h"] + [(nxt + a, nxt + b) for a, b in fwd_d2h],
            )
        while pending:
            landed = [c for c in pending if arrival[c] <= clock]
            if not landed:
                clock = min(arrival[c] for c in pending)
                continue
            chunk = min(landed)
            pending.remove(chunk)
            start, clock = clock, rates.end(clock, work[chunk] * self.chunk_params[chunk] / self.world_size)
            busy += clock - start
            wait = max(wait, clock - (nxt + window_start[chunk]))
        return {
            "forward_s": t_fwd,
            "backward_s": t_bwd,
            "gpu_optim_s": gpu_optim,
            "cpu_optim_s": busy,
            "cpu_optim_wait_s": wait,
        }
