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

import torch
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


SWAP = "protrain_swap"  # on a forward swap_out node: (slot, block)


def _base(node: fx.Node) -> fx.Node:
    """The node whose storage `node` views (itself when it is no view)."""
    while getattr(node.target, "is_view", False) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def swap_out_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Forward: every tensor a swapped block saves for backward goes to its host slot after its last forward use,
    and the graph hands the host copy to the backward instead of the device tensor.

        before:  h = mm(x, w); y = relu(h); return (y, h)          # h saved for backward
        after:   h = mm(x, w); y = relu(h); h_ = protrain.swap_out(space, 0, h); return (y, h_)
    """
    modes = ctx.plan.block_modes
    if ctx.stage != "forward" or "swap" not in modes:
        return gm
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    order = {n: i for i, n in enumerate(graph.nodes)}
    slot = 0
    for position, node in enumerate(outs):
        if not isinstance(node, fx.Node) or node.name not in ctx.saved:
            continue
        block = ctx.record.block_map.block.get(node.name)
        val = node.meta.get("val")
        if block is None or modes[block] != "swap" or not isinstance(val, torch.Tensor):
            continue
        if _base(node).op == "placeholder":
            continue  # a parameter or an input (or a view of one): its memory is not the block's to free
        last = max([node, *(u for u in node.users if u.op != "output")], key=order.__getitem__)
        with graph.inserting_after(last):
            host = graph.call_function(torch.ops.protrain.swap_out.default, (ctx.swap.handle, slot, node))
        with val.fake_mode:
            host.meta["val"] = torch.empty_like(val, device="cpu")
        host.meta[SWAP] = (slot, block)
        outs[position] = host
        slot += 1
    output.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return gm


def swap_in_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Backward: each swapped tensor comes back through `swap_in` before its first use; the tensors of block b
    are prefetched when the backward reaches block b + 1 (one block ahead), or at the start when block b + 1
    is not in this graph (no prefetch where its first use comes before that point).

        before:  h = placeholder; ...; g = mm(dy, h)
        after:   h = placeholder; ...; protrain.swap_prefetch(space, 0, <first node of block b+1>); ...
                 h_ = protrain.swap_in(space, 0, h); g = mm(dy, h_)
    """
    if ctx.stage != "backward":
        return gm
    swapped = {n.args[2].name: n for n in ctx.forward_outputs if SWAP in n.meta}
    if not swapped:
        return gm
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    by_block: dict[int, list[tuple[int, fx.Node]]] = {}
    for ph in placeholders:
        if ph.name not in swapped:
            continue
        out = swapped[ph.name]
        slot, block = out.meta[SWAP]
        assert ph.users, f"{ph.name}: a swapped tensor the backward does not read"
        first = min(ph.users, key=order.__getitem__)
        with graph.inserting_before(first):
            back = graph.call_function(torch.ops.protrain.swap_in.default, (out.args[0], slot, ph))
        back.meta["val"] = ph.meta.get("val")
        ph.meta["val"] = out.meta["val"]
        ph.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)
        by_block.setdefault(block, []).append((slot, back))
    handle = next(iter(swapped.values())).args[0]
    block_of = ctx.record.block_map.block
    for block, slots in by_block.items():
        ahead = [
            n
            for n in graph.nodes
            if n.op == "call_function"
            and block_of.get(n.name) == block + 1
            and isinstance(n.meta.get("val"), torch.Tensor)
        ]
        anchor = ahead[0] if ahead else placeholders[-1]
        order = {n: i for i, n in enumerate(graph.nodes)}
        with graph.inserting_after(anchor):
            for slot, back in slots:
                if order[anchor] < order[back]:  # a prefetch after the swap_in would fetch for nobody
                    graph.call_function(torch.ops.protrain.swap_prefetch.default, (handle, slot, anchor))
    graph.lint()
    gm.recompile()
    return gm
