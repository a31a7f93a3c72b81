"""Activation passes: per-block activation checkpointing (paper §3.2, "Interleaved Block Management").

checkpoint_tag_pass (joint graph, before partitioning): every forward op of a block whose plan mode is
"checkpoint" gets `node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE` and `node.meta["ac_graph_id"]`
= block + 1, the tags torch's own activation checkpointing leaves under compile. AOTAutograd's min-cut
partitioner then recomputes those ops in the backward instead of saving their outputs, so only the block's
input stays alive between forward and backward (at the boundary of two checkpointed blocks it saves the
earlier block's output: `ac_graph_id` tells it where one region ends). Random ops recompute with the
forward's RNG state (the partitioner's `functionalize_rng_ops`), so dropout masks match.

    before:  x1 = layer_norm(x0); h = mm(x1, w); y = add(x0, gelu(h))        # saved: x1, h, ...
    after:   same ops, each with meta recompute=MUST_RECOMPUTE, ac_graph_id=b+1   # saved: x0
"""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.capture import is_backward


def checkpoint_tag_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Tag the forward ops of checkpointed blocks for recomputation (see the module docstring)."""
    modes = ctx.plan.block_modes
    if "checkpoint" not in modes:
        return gm
    block_map = ctx.record.block_map
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_backward(node) or block_map.region.get(node.name) != "block":
            continue
        block = block_map.block[node.name]
        if modes[block] == "checkpoint":
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = block + 1
    return gm
