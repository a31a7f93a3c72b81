"""The peak-memory model (paper Appendix A.2): the allocated and reserved bytes of a configuration on the GPU, and
the host bytes it needs; methods of `CostModel` (planner/cost.py), which holds the fields they read.

The profile ran with every block unoptimized and every parameter on the device.
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
    until the backward reaches b (prefetches beyond that run only within the budget, so add no peak), but for
    those the backward of a block beyond b + swap_interval reads, which stay on the device;
  states: persistent chunks (parameters, master, AdamW's two states, and their gradients: one each, or
    `device_grad_slots` shared), the shards of the chunks sharded on the device (master, gradient, and AdamW's two
    states over the parameters of the rank's shard holding the most), chunk buffers, the landing shard of
    offloaded chunks and the reduce buffers of sharded ones,
    all but the parameters and buffers in the master dtype (fp32, or the parameters', which then need no
    master: the plan's `master_dtype`); with chunks the gradients the profile kept are taken out too (the
    runtime reduces them away per chunk).
α is measured: the allocator's reserved over allocated peak in the profiling run (1 on the CPU).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from protrain_fx.planner.plan import HOST_STATES, MIN_GRAD_SLOTS, REDUCE_BUFFERS

if TYPE_CHECKING:
    from protrain_fx.planner.cost import Candidate, ModeTerms
    from protrain_fx.planner.cost_fields import CostFields
else:
    CostFields = object  # (planner/cost_fields.py: the type checker's view of CostModel)

ADAM_STATES = 2  # exp_avg and exp_avg_sq, each of the master dtype, per parameter element


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of profiled nodes of one graph and one place: a block (0..n_block-1), or -1 before the blocks and
    n_block after them. `peak` is the highest per-node peak in it, as profiled."""

    graph: str
    place: int
    peak: int


class MemoryModel(CostFields):
    """Peak memory and host memory of a configuration: a base of `CostModel`, whose fields these read."""

    def saving(self, block: int, mode: str) -> int:
        """Bytes a block in `mode` does not hold between its forward and its backward (a selective one that keeps
        more than the block saved as profiled: less than 0)."""
        if mode == "swap":
            return self.block_saved[block] - self.kept_from_swap(block)
        if mode == "checkpoint":
            return max(0, self.block_saved[block] - self.block_output[block])
        if mode == "selective" and self.prices_selective:
            return self.block_saved[block] - self.block_kept[block]
        return 0

    def kept_from_swap(self, block: int) -> int:
        """Bytes a swapped block keeps on the device: what it saves that the backward of a block beyond its
        prefetch (block + swap_interval) reads, before the prefetch would bring it back."""
        later = self.block_saved_for_later[block] if self.block_saved_for_later else ()
        return sum(nbytes for reader, nbytes in later if reader > block + self.swap_interval)

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
        shards = range(config.n_persist, config.n_persist + config.n_device_shard)  # (master and gradient each)
        on_device = len(shards) * self.shard_elems * 2 * self.master_bytes
        on_device += sum(self.shard_params[c] for c in shards) * ADAM_STATES * self.master_bytes
        buffers = config.n_buffer * self.chunk_elems * self.element_size
        sharded = self.n_chunk - config.n_persist
        landing = self.shard_elems * self.master_bytes if sharded > config.n_device_shard and master else 0
        # what gradients are reduced in: a sharded chunk's always, a persistent one's across several ranks
        buffered = sharded + (config.n_persist if self.world_size > 1 else 0)
        reduce = min(REDUCE_BUFFERS, buffered) * self.chunk_elems * self.master_bytes
        if self.world_size > 1 and sharded:  # each buffer's shard the sharded chunks' gradients are scattered to
            reduce += min(REDUCE_BUFFERS, buffered) * self.shard_elems * self.master_bytes
        return persistent + on_device + buffers + landing + reduce

    def host_bytes(self, config: Candidate, grad_slots: int | None = None, terms: ModeTerms | None = None) -> int:
        """Host bytes of this rank the configuration needs (runtime/chunks/: what its host check asks for): per
        offloaded chunk its shard's master and host AdamW states, `grad_slots` gradient shards (default
        `grad_slots(config)`), and the swap space of the swapped blocks' activations (runtime/swap.py)."""
        offloaded = self.n_offloaded(config)
        slots = self.grad_slots(config) if grad_slots is None else grad_slots
        chunks = self.shard_elems * self.master_bytes * (offloaded * HOST_STATES + slots)
        return chunks + (terms or self.mode_terms(config, chunks=False)).swapped_bytes

    def grad_slots(self, config: Candidate) -> int:
        """The host gradient shards the offloaded chunks of `config` get (the user's, if forced): one each where
        `host_budget` has room (or is not set), else as many as it has, and no fewer than MIN_GRAD_SLOTS
        (`least_host_bytes`), which they share (runtime/chunks/slots.py)."""
        offloaded = self.n_offloaded(config)
        if self.forced_grad_slots is not None:
            return min(offloaded, self.forced_grad_slots)
        if self.host_budget is None or not offloaded:
            return offloaded
        room = (self.host_budget - self.host_bytes(config, 0)) // (self.shard_elems * self.master_bytes)
        return max(min(offloaded, MIN_GRAD_SLOTS), min(offloaded, room))

    def device_grad_slots(self, config: Candidate) -> int:
        """The gradient buffers the persistent chunks of `config` get on the device (the user's, if forced):
        one each, or MIN_GRAD_SLOTS, which they share (runtime/chunks/slots.py), with `share_device_grads`."""
        if self.forced_device_grad_slots is not None:
            return min(config.n_persist, self.forced_device_grad_slots)
        if self.share_device_grads:
            return min(config.n_persist, MIN_GRAD_SLOTS)
        return config.n_persist

    def least_host_bytes(self, config: Candidate, terms: ModeTerms | None = None) -> int:
        """The least host memory `config` trains in: its offloaded chunks sharing MIN_GRAD_SLOTS gradient shards."""
        return self.host_bytes(config, min(self.n_offloaded(config), MIN_GRAD_SLOTS), terms)

    def n_offloaded(self, config: Candidate) -> int:
        """The chunks `config` offloads: sharded on the host (after the persistent ones and those sharded on the
        device)."""
        return self.n_chunk - config.n_persist - config.n_device_shard

    def peak_bytes(self, config: Candidate, terms: ModeTerms | None = None) -> int:
        """The highest allocated bytes of a step (what torch.cuda.max_memory_allocated reports)."""
        activation_peak = terms.activation_peak if terms else self.activation_peak(self.modes(config))
        return activation_peak + self.state_bytes(config) + self.other_bytes

    def reserved_bytes(self, config: Candidate, peak_bytes: int | None = None) -> int:
        """The peak (`peak_bytes` if already known) times α: what the allocator reserves for it, so what must
        fit the GPU."""
        return int((self.peak_bytes(config) if peak_bytes is None else peak_bytes) * self.alpha)
