"""The cost models (paper §4.3, Appendix A): step time and peak GPU memory of any configuration, from one profile
of the graph (profiler/) and the hardware profile, without running it.

    model = CostModel.build(profile, hardware, n_block=..., layout=..., ...)
    model.step_s(Candidate(n_persist=4, n_buffer=2, n_swap=1, n_checkpoint=6, n_selective=8))
    model.peak_bytes(Candidate(...))

This module holds what a configuration is (`Candidate`), the record the formulas read (`CostModel`) and its building
from the profiles (`CostModel.build`), and the terms of a block's mode; the formulas are CostModel's methods, one
module per question: peak memory (planner/memory_model.py), step time (planner/timeline.py, with the link's rates
in planner/link.py), and the search's lower bounds of it (planner/bounds.py).

Compute times are the profiled node times; under inductor (`fused`) the nodes it fuses cost the bytes their
fused kernels move at the device's memory bandwidth instead (`node_s`, profiler/fusion.py).

swap_interval: how many blocks of forward compute it takes to hide one block's swap-out copy,
    N_interval = ceil(max over blocks of (bytes the block saves / device-to-host bandwidth) / block forward time)
It is settled before the search (paper line 231).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from protrain_fx.planner.bounds import StepBounds
from protrain_fx.planner.chunking import ChunkLayout
from protrain_fx.planner.memory_model import MemoryModel, Segment
from protrain_fx.planner.plan import interleaved_modes
from protrain_fx.planner.selective import selective_terms
from protrain_fx.planner.timeline import ModeWork, Timeline
from protrain_fx.profiler.fusion import EXTERN, is_matmul
from protrain_fx.profiler.hardware import HardwareProfile
from protrain_fx.profiler.profile import GraphProfile, NodeProfile


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
    """The searched fields of a plan (paper: n_persist, n_buffer, n_swap, n_checkpoint; and n_selective, and with
    several ranks n_device_shard)."""

    n_persist: int = 0
    n_buffer: int = 0
    n_swap: int = 0
    n_checkpoint: int = 0
    n_selective: int = 0
    n_device_shard: int = 0  # the chunks after the persistent ones sharded across the ranks on the device

    @classmethod
    def of(cls, plan: Any) -> Candidate:
        """The searched fields of `plan` (a Plan, or anything with its fields as attributes)."""
        return cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class ModeTerms:
    """What a configuration's costs read of its block modes alone (`CostModel.mode_terms`). The search's
    configurations share few block layouts, so it computes these once per layout and hands them to the methods
    that take `terms`."""

    activation_peak: int  # `CostModel.activation_peak` of its modes
    recompute_s: float  # seconds its blocks recompute in the backward
    swapped_bytes: int  # bytes its swapped blocks keep on the host
    per_chunk: ModeWork | None  # `CostModel._per_chunk_of_modes` (None without chunks)


@dataclasses.dataclass(frozen=True)
class CostModel(MemoryModel, Timeline, StepBounds):
    """What the cost formulas read about one graph; `build` derives it from the profiles and the chunk layout. The
    formulas are the methods of its bases: `MemoryModel` (peak memory), `Timeline` (step time), `StepBounds` (the
    search's lower bounds of it)."""

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
    shard_params: tuple[int, ...] = ()  # the most parameter elements a rank's shard of each chunk holds
    # (chunk, the chunk beside whose forward compute it is gathered again): a chunk the forward reads again after
    # other chunks (a tied embedding read by the head), where it is not persistent
    regathers: tuple[tuple[int, int], ...] = ()
    # for each n_persist, the fewest chunk buffers the graphs run with (passes/chunks.py `buffers_needed`); empty:
    # not known
    least_buffers: tuple[int, ...] = ()
    forced_modes: tuple[str, ...] = ()  # the user's block_modes, in place of the interleaved layout
    overlap: bool = True  # copies and host work run beside the compute (False on the CPU: the same cores do all)
    host_budget: int | None = None  # the host memory this rank has for offloaded chunks and swap (None: not budgeted)
    forced_grad_slots: int | None = None  # the user's host_grad_slots (at most one per offloaded chunk is used)
    forced_device_grad_slots: int | None = None  # the user's device_grad_slots (at most one per persistent chunk)
    # the persistent chunks share MIN_GRAD_SLOTS gradient buffers (the search's last resort, planner/search.py)
    share_device_grads: bool = False
    timing_noise: float = 0.0  # the profile's (GraphProfile.timing_noise): the search ties step times within it
    # training's step time outside its forward and backward phases (the loop's own time, the device AdamW's part)
    # less the model's prediction there, as the closed loop measured it (planner/calibrate.py); the same for every plan
    step_offset_s: float = 0.0
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
    # per block, (the highest block whose backward reads it, bytes) of each tensor it saves that a later block's
    # backward reads too (an attention mask made in the first block): a swapped block keeps those the backward
    # needs before its prefetch on the device (passes/activations.py `swap_out_pass`)
    block_saved_for_later: tuple[tuple[tuple[int, int], ...], ...] = ()

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
        last block + 1: after the blocks), as backend/planning.py's `_regathers` finds them;
        `other_bytes`: what the device holds besides the activations and the states `state_bytes` counts (with a
        layout: the profile's baseline less the parameters; without: the whole baseline); `grad_outputs`: names of
        the backward nodes that are parameter gradients (with a layout, the runtime frees each after its chunk's
        reduce); `fused`: the graphs run under a fusing compiler (inductor), see `node_s`; `master_bytes`: the
        plan's master dtype's (planner/plan.py master_bytes)."""
        places = _places(profile, n_block)
        seconds, matmuls, stretch = _sustained_seconds(profile, hardware, fused=fused)
        times = _BlockTimes.of(profile, n_block, places, seconds, matmuls)
        selective = selective_terms(profile.nodes, seconds, n_block)
        segments = _segments(profile, places, grad_outputs if layout is not None else frozenset(), fused=fused)
        blocks = {b.block: b for b in profile.blocks}
        for_later = _saved_for_later(profile, n_block)
        chunks = _chunk_fields(layout, block_of_param, regathers, n_block, master_bytes) if layout is not None else {}
        priced: dict[str, Any] = {}  # a selective block's terms, where the profile prices it
        if selective is not None:
            priced = dict(
                block_kept=selective.kept,
                block_selective_s=selective.recompute_s,
                block_selective_transient=selective.transient,
            )
        return cls(
            n_block=n_block,
            swap_interval=swap_interval,
            block_fwd_s=times.fwd,
            block_bwd_s=times.bwd,
            block_saved=tuple(blocks[b].saved_bytes if b in blocks else 0 for b in range(n_block)),
            block_saved_for_later=tuple(tuple(pairs) for pairs in for_later) if any(for_later) else (),
            block_output=times.output,
            block_transient=times.transient,
            other_fwd_s=times.other_fwd,
            other_bwd_s=times.other_bwd,
            segments=segments,
            hardware=hardware,
            alpha=profile.fragmentation,
            timing_noise=profile.timing_noise,
            overlap=not profile.device.startswith("cpu"),
            other_bytes=other_bytes,
            backward_matmul_share=times.backward_matmul_share,
            matmul_stretch=stretch,
            **chunks,
            **priced,
        )

    # ----- block modes -------------------------------------------------------------------------------

    @classmethod
    def of_states(cls, layout: ChunkLayout, master_bytes: int) -> CostModel:
        """The model of a chunk layout's states alone, before any profile: no blocks, no activations, no times
        (`hardware` None: its memory methods only), the persistent chunks sharing gradient buffers as the search's
        last resort does. What it needs is the least any plan of the layout needs."""
        return cls(
            n_block=0,
            swap_interval=1,
            block_fwd_s=(),
            block_bwd_s=(),
            block_saved=(),
            block_output=(),
            block_transient=(),
            other_fwd_s=(0.0, 0.0),
            other_bwd_s=(0.0, 0.0),
            segments=(),
            hardware=None,  # type: ignore[arg-type]  # (its memory methods read no hardware)
            **_layout_fields(layout),
            master_bytes=master_bytes,
            share_device_grads=True,
        )

    def modes(self, config: Candidate) -> tuple[str, ...]:
        return self.forced_modes or interleaved_modes(
            self.n_block, config.n_swap, config.n_checkpoint, config.n_selective
        )

    @property
    def prices_selective(self) -> bool:
        """The profile marked what selective blocks keep and recompute (planner/selective.py)."""
        return bool(self.block_kept)

    def recompute_s(self, block: int, mode: str) -> float:
        """Seconds a block's backward recomputes: a checkpointed block's forward, a selective one's marked ops."""
        if mode == "checkpoint":
            return self.block_fwd_s[block]
        if mode == "selective" and self.prices_selective:
            return self.block_selective_s[block]
        return 0.0

    def mode_terms(self, config: Candidate, *, chunks: bool = True) -> ModeTerms:
        """What `config`'s costs read of its block modes alone; `chunks` False: without the per-chunk split."""
        modes = self.modes(config)
        return ModeTerms(
            activation_peak=self.activation_peak(modes) if chunks else 0,
            recompute_s=sum(self.recompute_s(b, m) for b, m in enumerate(modes)),
            swapped_bytes=sum(self.saving(b, m) for b, m in enumerate(modes) if m == "swap"),
            per_chunk=self._per_chunk_of_modes(config) if chunks and self.n_chunk else None,
        )


def _layout_fields(layout: ChunkLayout) -> dict:
    """The CostModel fields a chunk layout gives: its sizes, and each chunk's parameter elements (padding excluded)."""
    chunk_params = [0] * layout.n_chunk
    shard_params = [[0] * layout.world_size for _ in range(layout.n_chunk)]  # chunk -> rank -> elements
    shard = layout.shard_elems
    for slot in layout.slots:
        chunk_params[slot.chunk] += slot.numel
        for rank in range(slot.offset // shard, (slot.offset + slot.numel - 1) // shard + 1):
            lo, hi = max(slot.offset, rank * shard), min(slot.offset + slot.numel, (rank + 1) * shard)
            shard_params[slot.chunk][rank] += hi - lo
    return dict(
        n_chunk=layout.n_chunk,
        chunk_elems=layout.chunk_elems,
        shard_elems=layout.shard_elems,
        element_size=layout.element_size,
        world_size=layout.world_size,
        chunk_params=tuple(chunk_params),
        shard_params=tuple(max(ranks) for ranks in shard_params),
    )


def _places(profile: GraphProfile, n_block: int) -> list[int]:
    """Where each node is, -1 before the blocks to n_block after them. Forward: the highest block reached so far
    (the views AOTAutograd adds at the end of the forward, tagged with early blocks, stay after the last block); a
    node outside the blocks once the last block is entered is after them. Backward: the highest block with nodes
    still to come (nodes tagged with a lower block that run early, as shared gradients do, do not end the blocks
    above them); a node outside the blocks sits before that block (n_block at the start), or before the blocks
    (-1) once none is to come."""
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
    return places


def _sustained_seconds(
    profile: GraphProfile, hardware: HardwareProfile, *, fused: bool
) -> tuple[list[float], list[bool], float]:
    """Each node's time as profiled in a short burst (`node_s` under a fusing compiler), its matmuls' slower in the
    sustained workload of training, by the hardware profile's stretch at this graph's share of matmul time (its
    clocks at the power limit); which nodes are matmuls; and that stretch."""
    burst = [node_s(node, hardware) if fused else node.latency_s for node in profile.nodes]
    matmuls = [is_matmul(node.target) for node in profile.nodes]
    total_s = sum(burst)
    share = sum(s for s, matmul in zip(burst, matmuls) if matmul) / total_s if total_s > 0 else 0.0
    stretch = hardware.sustained_matmul_stretch(share)
    return [s * stretch if matmul else s for s, matmul in zip(burst, matmuls)], matmuls, stretch


_OTHER = (("forward", "pre"), ("forward", "post"), ("backward", "pre"), ("backward", "post"))  # outside the blocks


@dataclasses.dataclass(frozen=True)
class _BlockTimes:
    """The compute seconds of each block's forward and backward and of what runs outside the blocks, and the
    block terms read off the same walk over the nodes (`of`): the CostModel fields of the same names."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    other_fwd: tuple[float, float]  # the forward's seconds before and after the blocks
    other_bwd: tuple[float, float]
    output: tuple[int, ...]  # bytes of each block's output: its forward's last new tensor
    transient: tuple[int, ...]  # each block's highest intra-op spike in its forward
    backward_matmul_share: float  # of the backward's seconds, the share in matmuls

    @classmethod
    def of(
        cls, profile: GraphProfile, n_block: int, places: list[int], seconds: list[float], matmuls: list[bool]
    ) -> _BlockTimes:
        """`places`: each node's (`_places`); `seconds`: each node's time and `matmuls` whether it is one
        (`_sustained_seconds`)."""
        fwd, bwd, output, transient = [0.0] * n_block, [0.0] * n_block, [0] * n_block, [0] * n_block
        other = dict.fromkeys(_OTHER, 0.0)
        backward_s, matmul_s = 0.0, 0.0
        for node, at, s, matmul in zip(profile.nodes, places, seconds, matmuls):
            if node.graph == "backward":
                backward_s += s
                matmul_s += s if matmul else 0.0
            if node.block is None or at != node.block:
                other[(node.graph, "post" if at == n_block else "pre")] += s
            elif node.graph == "backward":
                bwd[node.block] += s
            else:
                fwd[node.block] += s
                if node.output_bytes:
                    output[node.block] = node.output_bytes  # the block's last new tensor, in the end
                transient[node.block] = max(transient[node.block], node.intra_delta_bytes)
        return cls(
            fwd=tuple(fwd),
            bwd=tuple(bwd),
            other_fwd=(other[("forward", "pre")], other[("forward", "post")]),
            other_bwd=(other[("backward", "pre")], other[("backward", "post")]),
            output=tuple(output),
            transient=tuple(transient),
            backward_matmul_share=matmul_s / backward_s if backward_s > 0 else 0.0,
        )


def _segments(
    profile: GraphProfile, places: list[int], grad_outputs: frozenset[str], *, fused: bool
) -> tuple[Segment, ...]:
    """The peaks above the profile's baseline, one per run of nodes in one place (`_places`): each node's allocated
    bytes and spike, less the parameter gradients made before it (`grad_outputs`: those the runtime frees after
    their chunk's reduce) and, under a fusing compiler, the tensors its fused kernels never allocate."""
    segments: list[Segment] = []
    grads_freed = 0
    for node, at in zip(profile.nodes, places):
        spike = max(node.intra_delta_bytes, node.inter_delta_bytes, 0)
        peak = node.allocated_before + spike - profile.baseline_bytes - grads_freed
        if fused:
            peak -= node.unfused_bytes
        if node.graph == "backward" and node.name in grad_outputs:
            grads_freed += node.output_bytes
        if segments and (segments[-1].graph, segments[-1].place) == (node.graph, at):
            segments[-1] = dataclasses.replace(segments[-1], peak=max(segments[-1].peak, peak))
        else:
            segments.append(Segment(node.graph, at, peak))
    return tuple(segments)


def _saved_for_later(profile: GraphProfile, n_block: int) -> list[list[tuple[int, int]]]:
    """Per block, (the highest block whose backward reads it, bytes) of each tensor it saves that a later block's
    backward reads too (`CostModel.block_saved_for_later`)."""
    for_later: list[list[tuple[int, int]]] = [[] for _ in range(n_block)]
    for node in profile.nodes:
        if node.graph == "forward" and node.block is not None and node.block < n_block and node.saved_bytes:
            if node.needed_from_block is not None and node.needed_from_block > node.block:
                for_later[node.block].append((node.needed_from_block, node.saved_bytes))
    return for_later


def _chunk_fields(
    layout: ChunkLayout,
    block_of_param: Sequence[int | None],
    regathers: Sequence[tuple[int, int]],
    n_block: int,
    master_bytes: int,
) -> dict[str, Any]:
    """The CostModel fields of a chunked graph: the layout's (`_layout_fields`), the chunk holding each block's
    parameters (its first), and each chunk gathered again beside the forward of the chunk of the block it is read
    in (the last chunk's, after the blocks)."""
    block_chunk = [layout.n_chunk - 1] * n_block
    for slot, block in zip(layout.slots, block_of_param):
        if block is not None and block < n_block:
            block_chunk[block] = min(block_chunk[block], slot.chunk)
    return dict(
        **_layout_fields(layout),
        block_chunk=tuple(block_chunk),
        regathers=tuple((chunk, block_chunk[b] if b < n_block else layout.n_chunk - 1) for chunk, b in regathers),
        master_bytes=master_bytes,
    )
