"""The price of a selective block (planner/plan.py's "selective" mode), per block, from the profile.

The profile ran every block in "none" mode; `profiler/selective.py` marked each forward node with what a selective
block would do with it (`NodeProfile.kept_bytes`, `NodeProfile.recomputed`). A selective block b then:
  keeps       the kept bytes of its nodes (the outputs of its matmuls and attention that the backward reads,
              directly or through a recomputed op, and its output), in place of the block's saved bytes as
              profiled: it holds block_saved[b] - kept[b] less from its forward to its backward;
  recomputes  its marked nodes in the backward: their forward seconds, as the cost model times any node
              (`CostModel.build`: profiled, or inductor's fused estimate), added to the block's backward;
  spikes      by the highest intra-op delta of those nodes while it recomputes them (the memory model adds it
              at the block's backward, as it adds a checkpointed block's forward transient).
The RNG state saved per recomputed random op (a few KiB on the CPU, 16 bytes on CUDA) is not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from protrain_fx.profiler.profile import NodeProfile


@dataclasses.dataclass(frozen=True)
class SelectiveTerms:
    kept: tuple[int, ...]  # bytes each block keeps for the backward when selective
    recompute_s: tuple[float, ...]  # seconds of its recompute in the backward
    transient: tuple[int, ...]  # the highest intra-op spike of its recomputed ops


def selective_terms(nodes: Sequence[NodeProfile], seconds: Sequence[float], n_block: int) -> SelectiveTerms | None:
    """Per block, what a selective block keeps, recomputes and spikes by; `seconds`: each node's time as the cost
    model takes it. None where no node is marked (no block, or a profile written before the marks): the mode is
    then not priced and never searched."""
    if not any(n.recomputed for n in nodes):
        return None
    kept, recompute, transient = [0] * n_block, [0.0] * n_block, [0] * n_block
    for node, s in zip(nodes, seconds):
        if node.graph != "forward" or node.block is None or not 0 <= node.block < n_block:
            continue
        kept[node.block] += node.kept_bytes
        if node.recomputed:
            recompute[node.block] += s
            transient[node.block] = max(transient[node.block], node.intra_delta_bytes)
    return SelectiveTerms(tuple(kept), tuple(recompute), tuple(transient))
