"""Synthetic cost models for the planner's tests, with GPU-like hardware figures, where every choice has a price."""

import dataclasses
import random

from protrain_fx.planner.cost import Candidate, CostModel
from protrain_fx.planner.memory_model import Segment
from protrain_fx.planner.search import brute_force
from protrain_fx.profiler.hardware import HardwareProfile

GiB = 2**30
H100_LIKE = HardwareProfile(
    key={},
    h2d_bytes_per_s=50e9,
    d2h_bytes_per_s=50e9,
    h2d_concurrent_bytes_per_s=40e9,
    d2h_concurrent_bytes_per_s=40e9,
    h2d_beside_host_bytes_per_s=40e9,
    d2h_beside_host_bytes_per_s=50e9,
    both_beside_host_bytes_per_s=35e9,
    device_bytes_per_s=3e12,
    kernel_s=3e-6,
    device_adam_s_per_param=2e-11,
    host_adam_s_per_param=2e-10,
    host_adam_h2d_s_per_param=2e-10,
    host_adam_d2h_s_per_param=2e-10,
    host_adam_both_s_per_param=2e-10,
    host_undo_s_per_param=1e-10,
    device_memory_bytes=80 * GiB,
    host_memory_bytes=128 * GiB,
    collectives={},
)


# H100_LIKE on two ranks, for the gloo tests to plan with in place of the profile measured under whatever load they
# run with (its collectives of small chunks move by several times between runs): ring collectives (an all-reduce
# takes as long as a reduce-scatter and an all-gather) and the host's AdamW ten times the device's, so that
# offloading a chunk always costs more than keeping it on the device
RING = [(2**20, 1e-4), (2**30, 0.1)]  # a reduce-scatter's or an all-gather's (message bytes, seconds)
TWO_RANKS = dataclasses.replace(
    H100_LIKE,
    collectives={"all_gather": RING, "reduce_scatter": RING, "all_reduce": [(b, 2 * s) for b, s in RING]},
)


def synthetic(n_block=8, n_chunk=6, seed=0, block_saved=1 * GiB, chunk_elems=2**28) -> CostModel:
    """A transformer-like model: activations pile up over the forward and drain over the backward."""
    rng = random.Random(seed)
    fwd = tuple(rng.uniform(0.004, 0.008) for _ in range(n_block))
    saved = tuple(int(block_saved * rng.uniform(0.8, 1.2)) for _ in range(n_block))
    segments, held = [Segment("forward", -1, 0)], 0
    for b in range(n_block):
        held += saved[b]
        segments.append(Segment("forward", b, held + saved[b] // 4))
    segments += [Segment("forward", n_block, held + GiB), Segment("backward", n_block, held + 2 * GiB)]
    for b in reversed(range(n_block)):
        segments.append(Segment("backward", b, held + saved[b] // 2))
        held -= saved[b]
    return CostModel(
        n_block=n_block,
        swap_interval=2,
        block_fwd_s=fwd,
        block_bwd_s=tuple(2 * t for t in fwd),
        block_saved=saved,
        block_output=tuple(s // 16 for s in saved),
        block_transient=tuple(s // 8 for s in saved),
        other_fwd_s=(0.001, 0.004),
        other_bwd_s=(0.001, 0.008),
        segments=tuple(segments),
        hardware=H100_LIKE,
        n_chunk=n_chunk,
        chunk_elems=chunk_elems,
        shard_elems=chunk_elems,
        element_size=2,
        block_chunk=tuple(b * n_chunk // n_block for b in range(n_block)),
        chunk_params=(chunk_elems,) * n_chunk,
        shard_params=(chunk_elems,) * n_chunk,
    )


def capacities(model):
    everything = model.peak_bytes(Candidate(model.n_chunk, 0, 0, 0))
    least = min(model.peak_bytes(c) for c, _, _ in brute_force(model, None))
    return [int(least + (everything - least) * f) for f in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.2)]


def linked(model: CostModel, **rates) -> CostModel:
    """`model` with every link rate the same (`rate`) but those named."""
    same = dict.fromkeys(
        ("h2d", "d2h", "h2d_concurrent", "d2h_concurrent", "h2d_beside_host", "d2h_beside_host", "both_beside_host"),
        rates.pop("rate", 50e9),
    )
    fields = {f"{k}_bytes_per_s": v for k, v in {**same, **rates}.items()}
    return dataclasses.replace(model, hardware=dataclasses.replace(model.hardware, **fields))


def beside_matmuls(model: CostModel, hidden: float, stretch: float = 1.0, matmul_share: float = 1.0) -> CostModel:
    """`model` whose device AdamW hides `hidden` of its time beside matmuls, taking `stretch` times as long there,
    and whose backward spends `matmul_share` of its time in matmuls."""
    hw = dataclasses.replace(
        model.hardware, device_adam_hidden_beside_matmul=hidden, device_adam_stretch_beside_matmul=stretch
    )
    return dataclasses.replace(model, hardware=hw, backward_matmul_share=matmul_share)


def on_two_ranks(seconds: float, stretch: float = 1.0, delay: float = 0.0) -> CostModel:
    """`synthetic()` sharded over two ranks, whose every collective of a chunk takes `seconds` alone, `stretch`
    times as long beside the compute, which it makes end `delay` of that later."""
    model = synthetic(n_chunk=6)
    points = [(2**20, seconds * 2**20 / (model.chunk_elems * 4)), (model.chunk_elems * 4, seconds)]
    hw = dataclasses.replace(
        model.hardware,
        collectives=dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce"), points),
        collective_stretch_beside_matmul=stretch,
        matmul_delay_beside_collective=delay,
    )
    shard = model.chunk_elems // 2
    return dataclasses.replace(
        model, hardware=hw, world_size=2, shard_elems=shard, shard_params=(shard,) * model.n_chunk
    )
