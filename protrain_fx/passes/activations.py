"""Activation passes: per-block activation checkpointing, full or selective, and swapping (paper §3.2,
"Interleaved Block Management").

checkpoint_tag_pass (joint graph, before partitioning): every forward op of a block whose plan mode is
"checkpoint" gets `node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE` and `node.meta["ac_graph_id"]`
= block + 1, the tags torch's own activation checkpointing leaves under compile. AOTAutograd's min-cut
partitioner then recomputes those ops in the backward instead of saving their outputs, so only the block's
input stays alive between forward and backward (at the boundary of two checkpointed blocks it saves the
earlier block's output: `ac_graph_id` tells it where one region ends). Random ops recompute with the
forward's RNG state (the partitioner's `functionalize_rng_ops`), so dropout masks match.

    before:  x1 = layer_norm(x0); h = mm(x1, w); y = add(x0, gelu(h))        # saved: x1, h, ...
    after:   same ops, each with meta recompute=MUST_RECOMPUTE, ac_graph_id=b+1   # saved: x0

A "selective" block's ops get the per-op tags of torch's selective activation checkpointing instead
(profiler/selective.py `policy`): MUST_SAVE on library kernels (matmuls, attention) and on the block's outputs,
PREFER_RECOMPUTE on the rest, so the backward runs the norms, activations, casts and dropout masks again from
the saved matmul outputs, and no matmul twice:

    before:  x1 = layer_norm(x0); h = mm(x1, w); y = add(x0, gelu(h))        # saved: x1, h, ...
    after:   x1: PREFER_RECOMPUTE, h: MUST_SAVE, gelu: PREFER_RECOMPUTE, y: MUST_SAVE   # saved: x0, h, y
"""

from __future__ import annotations

import bisect
import collections
import logging
from typing import cast

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.capture import is_backward
from protrain_fx.passes.contract import (
    AC_GRAPH_ID,
    BACKWARD,
    FORWARD,
    JOINT,
    RECOMPUTE,
    PassContext,
    graph_pass,
    required_block_map,
    required_plan,
)
from protrain_fx.passes.views import view_base
from protrain_fx.profiler.selective import policy
from protrain_fx.shapes import dense_order, strides_in

log = logging.getLogger(__name__)


@graph_pass(graphs=(JOINT,), requires=("plan", "record"), provides=(RECOMPUTE, AC_GRAPH_ID))
def checkpoint_tag_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Tag the forward ops of checkpointed and selective blocks for recomputation (see the module docstring)."""
    modes = required_plan(ctx).block_modes
    if "checkpoint" not in modes and "selective" not in modes:
        return gm
    block_map = required_block_map(ctx)
    block_of, region = block_map.block, block_map.region
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_backward(node) or region.get(node.name) != "block":
            continue
        block = block_of[node.name]
        assert block is not None, f"{node.name}: in the block region with no block"
        if modes[block] == "checkpoint":
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        elif modes[block] == "selective":
            node.meta["recompute"] = policy(node, block, block_of)
        else:
            continue
        node.meta["ac_graph_id"] = block + 1
    return gm


@graph_pass(graphs=(BACKWARD,), requires=("plan", "forward_placeholders"), requires_tags=(RECOMPUTE, AC_GRAPH_ID))
def recompute_order_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Backward: a checkpointed block's recompute starts only after the backward work before it. The partitioner
    puts each recompute right before its first use, but inductor fuses kernels of nearby nodes that read the
    same buffers (the rotary cos/sin every block reads), which pulled block b-1's recompute into block b's
    backward and held two blocks' recomputed activations at once. The activations the recompute reads go
    through `protrain.after(x, [values live there])`, a copy that exists only after everything computed before
    the recompute's place. A selective block's recompute (PREFER_RECOMPUTE) is left where the partitioner puts
    it: it reads the block's kept matmul outputs, which such copies would double, and its cheap ops are what
    inductor fuses into the backward kernels that read them.

        before:  ...block b's backward...; h = mm(x, w); ...                 # h: block b-1 recomputed
        after:   ...block b's backward...; x2 = protrain.after(x, [dx, dw, ...]); h = mm(x2, w); ...
    """
    if ctx.stage != "backward" or "checkpoint" not in required_plan(ctx).block_modes:
        return gm
    graph = gm.graph
    regions: dict[int, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
            regions.setdefault(n.meta.get("ac_graph_id"), []).append(n)
    params = _parameter_views(ctx.forward_placeholders, graph)
    waited: set[fx.Node] = set()  # an earlier region's deps: the gradient chain orders this region after them
    for nodes in regions.values():  # in graph order
        members, first = set(nodes), nodes[0]
        order = {n: i for i, n in enumerate(graph.nodes)}
        live = [
            n
            for n in graph.nodes
            if order[n] < order[first]
            and n not in waited
            and n.op == "call_function"
            and n.name not in params
            and isinstance(n.meta.get("val"), torch.Tensor)
            and any(order[u] >= order[first] for u in n.users)
        ]
        waited.update(live)
        inputs = {
            a
            for n in nodes
            for a in n.all_input_nodes
            if a not in members
            and a.name not in params
            and isinstance(a.meta.get("val"), torch.Tensor)
            and a.meta["val"].numel() > 0
        }
        if not live or not inputs:
            continue
        for x in sorted(inputs, key=order.__getitem__):
            readers = [n for n in nodes if x in n.all_input_nodes]
            with graph.inserting_before(min(readers, key=order.__getitem__)):  # x may come after `first`
                copy = graph.call_function(torch.ops.protrain.after.default, (x, live))
            val = x.meta["val"]
            with val.fake_mode:
                copy.meta["val"] = torch.empty_like(val)
            for n in readers:
                n.replace_input_with(x, copy)
            log.debug(
                "recompute of region %s reads %s %s after %d values",
                first.meta.get("ac_graph_id"),
                x.name,
                tuple(val.shape),
                len(live),
            )
    graph.lint()
    gm.recompile()
    return gm


def _parameter_views(forward_placeholders, backward: fx.Graph) -> set[str]:
    """Names of the parameters and of values made from them by views alone, in the forward (a transposed
    weight saved for the backward) and in the backward: the recompute reads them as they are, never through a
    copy, and never waits on them (waiting would hold their chunks gathered)."""
    names = {p.name for p in forward_placeholders}
    for graph in (forward_placeholders[0].graph, backward) if forward_placeholders else ():
        names.update(n.name for n in graph.nodes if view_base(n).name in names)  # in graph order: views of views too
    return names


SWAP = "protrain_swap"  # on a forward swap_out node: (slot, block)


@graph_pass(graphs=(FORWARD,), requires=("plan", "record", "saved", "needed_from", "swap"), provides=(SWAP,))
def swap_out_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Forward: every tensor a swapped block saves for backward goes to its host slot after its last forward use,
    and the graph hands the host copy to the backward instead of the device tensor; but for one the backward of a
    block beyond its prefetch reads (an attention mask made in the first block, read by every block): that one
    would come back where the backward starts, and stays.

        before:  h = mm(x, w); y = relu(h); return (y, h)          # h saved for backward
        after:   h = mm(x, w); y = relu(h); h_ = protrain.swap_out(space, 0, h, [1, 0]); ...
                 a = <first node of block b + swap_interval>; protrain.swap_settle(space, [0], [h_], [h], a); ...
                 return (y, h_)
    """
    plan = required_plan(ctx)
    modes = plan.block_modes
    if ctx.stage != "forward" or "swap" not in modes:
        return gm
    assert ctx.swap is not None, f"the {ctx.stage} graph swaps blocks {modes} with no swap space"
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    order = {n: i for i, n in enumerate(graph.nodes)}
    slot = 0
    # the forward returns the user's outputs, then what the backward saves (as many as it has saved inputs); a
    # tensor that is both stays on the device for the user
    first_saved = len(outs) - len(ctx.saved)
    # a value saved at two positions (two of the backward's inputs) stays on the device: one host copy would be
    # swapped in twice
    repeated = {n for n, count in collections.Counter(outs[first_saved:]).items() if count > 1}
    for position, node in enumerate(outs):
        if position < first_saved or not isinstance(node, fx.Node) or node.name not in ctx.saved or node in repeated:
            continue
        block = required_block_map(ctx).block.get(node.name)
        val = node.meta.get("val")
        if block is None or modes[block] != "swap" or not isinstance(val, torch.Tensor):
            continue
        if view_base(node).op == "placeholder":
            continue  # a parameter or an input (or a view of one): its memory is not the block's to free
        if ctx.needed_from.get(node.name, block) > block + plan.swap_interval:
            continue  # read by the backward of a block before this one's prefetch: kept (MemoryModel.kept_from_swap)
        last = max([node, *(u for u in node.users if u.op != "output")], key=order.__getitem__)
        layout = dense_order(val)  # the slot: val's layout where it is dense (a transpose, say), else contiguous
        with val.fake_mode:  # type: ignore[attr-defined]  # (a FakeTensor: the partitioner's values)
            host_val = torch.empty_strided(val.shape, strides_in(val.shape, layout), dtype=val.dtype, device="cpu")
        with graph.inserting_after(last):
            args = (ctx.swap.handle, slot, node, layout)
            host = graph.call_function(torch.ops.protrain.swap_out.default, args)
        host.meta["val"] = host_val
        host.meta[SWAP] = (slot, block)
        outs[position] = host
        slot += 1
    output.args = (tuple(outs),)
    _settle_forward(graph, ctx)
    graph.lint()
    gm.recompile()
    return gm


def _first_nodes(graph: fx.Graph, ctx: PassContext, among: set[fx.Node] | None = None) -> dict[int | str, fx.Node]:
    """Block -> its first computing node in `graph` (of `among`, if given), and "post" -> the first one after the
    last block."""
    block_map = required_block_map(ctx)
    block_of, region = block_map.block, block_map.region
    first: dict[int | str, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor) and (among is None or n in among):
            if n.name in block_of:
                if (block := block_of[n.name]) is not None:
                    first.setdefault(block, n)
            elif region.get(n.name) == "post":
                first.setdefault("post", n)
    return first


def _reached_from(graph: fx.Graph, roots: set[fx.Node]) -> set[fx.Node]:
    """`roots` and the nodes that read them, directly or not. An anchor of a swap op is taken among these: a node
    that reads only parameters (a weight's cast) may be scheduled anywhere by the compiler, and the op with it."""
    reached = set(roots)
    for n in graph.nodes:
        if any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    return reached


def _settle_forward(graph: fx.Graph, ctx: PassContext) -> None:
    """Swapped block b's copies must be done swap_interval blocks later (the plan counts on it): there, a
    `swap_settle` makes the compute stream wait for them and frees their device tensors. A tensor swapped out
    only after that point is settled at the forward's last node. The settle reads the device tensors, so no
    compiler reuses their memory before it while a copy on the side stream may still be reading them."""
    block_of, interval = required_block_map(ctx).block, required_plan(ctx).swap_interval
    assert ctx.swap is not None, "swap_out_pass settles its copies with the swap space"
    # the forward's last computed value: a settle there waits for the copies once all compute is queued
    last = next(
        n
        for n in reversed(graph.nodes)
        if n.op == "call_function" and SWAP not in n.meta and isinstance(n.meta.get("val"), torch.Tensor)
    )
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_block: dict[int, list[fx.Node]] = {}
    for n in graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default):
        by_block.setdefault(n.meta[SWAP][1], []).append(n)
    at: dict[fx.Node, list[fx.Node]] = {}  # anchor -> the swap_outs it settles
    for block, outs in by_block.items():
        # where the forward reaches block b + swap_interval: its first node that block b's output flows into
        first = _first_nodes(
            graph, ctx, among=_reached_from(graph, {n for n in graph.nodes if block_of.get(n.name) == block})
        )
        anchor = first.get(block + interval, first.get("post"))
        for n in outs:
            at.setdefault(anchor if anchor is not None and order[n] < order[anchor] else last, []).append(n)
    for anchor, outs in at.items():
        with graph.inserting_after(max([anchor, *outs], key=order.__getitem__)):
            slots, sources = [n.args[1] for n in outs], [n.args[2] for n in outs]
            graph.call_function(torch.ops.protrain.swap_settle.default, (ctx.swap.handle, slots, outs, sources, anchor))


@graph_pass(graphs=(BACKWARD,), requires=("plan", "record", "forward_outputs"), requires_forward_tags=(SWAP,))
def swap_in_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Backward: each swapped tensor comes back through `swap_in` before its first use; block b's tensors are
    prefetched together when the gradient reaches block b + swap_interval (the plan's), or at the start when
    that block is not in this graph (no prefetch where the first use comes before that point).

        before:  h = placeholder; ...; g = mm(dy, h)
        after:   h = placeholder; ...; protrain.swap_prefetch(space, [0, ...], <first node of block b+k>); ...
                 h_ = protrain.swap_in(space, 0, h, [dy]); g = mm(dy, h_)

    Both ops take a value the output gradients (`tangents_*`) flow into, computed where the backward is then:
    one that reads only parameters (a weight's cast) or a swap_in that reads only its placeholder may be
    scheduled anywhere by the compiler, bringing a block back long before the backward needs it, at its peak.
    """
    if ctx.stage != "backward":
        return gm
    swapped = {cast(fx.Node, n.args[2]).name: n for n in ctx.forward_outputs if SWAP in n.meta}  # (swap_out's tensor)
    if not swapped:
        return gm
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    gradient = _reached_from(graph, {n for n in placeholders if n.name.startswith("tangents")})
    gradient_order = [order[n] for n in graph.nodes if n in gradient and isinstance(n.meta.get("val"), torch.Tensor)]
    by_order = list(graph.nodes)
    by_block: dict[int, list[tuple[int, fx.Node]]] = {}
    for ph in placeholders:
        if ph.name not in swapped:
            continue
        out = swapped[ph.name]
        slot, block = out.meta[SWAP]
        assert ph.users, f"{ph.name}: a swapped tensor the backward does not read"
        first = min(ph.users, key=order.__getitem__)
        # the last value the gradient flows into before the first use (none: the use comes first)
        at = bisect.bisect_left(gradient_order, order[first])
        after = [by_order[gradient_order[at - 1]]] if at else []
        with graph.inserting_before(first):
            back = graph.call_function(torch.ops.protrain.swap_in.default, (out.args[0], slot, ph, after))
        host = out.meta["val"]  # (the slot's strides: the saved tensor's where it is dense)
        with host.fake_mode:
            back.meta["val"] = torch.empty_strided(
                host.shape, host.stride(), dtype=host.dtype, device=ph.meta["val"].device
            )
        ph.meta["val"] = host
        ph.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)
        by_block.setdefault(block, []).append((slot, back))
    handle = next(iter(swapped.values())).args[0]
    # where the backward reaches a block: its first node the gradient flows into
    first_of = {**_first_nodes(graph, ctx), **_first_nodes(graph, ctx, among=gradient)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    # a block the backward reaches first has no block k ahead of it: its prefetch follows the inputs (the last one
    # holding a tensor: on CUDA the recompute's RNG generators come last)
    inputs = [n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
    for block, slots in by_block.items():
        anchor = first_of.get(block + required_plan(ctx).swap_interval, inputs[-1])
        ahead = [slot for slot, back in slots if order[anchor] < order[back]]  # else it would fetch for nobody
        if ahead:
            with graph.inserting_after(anchor):
                graph.call_function(torch.ops.protrain.swap_prefetch.default, (handle, ahead, anchor))
    graph.lint()
    gm.recompile()
    return gm
