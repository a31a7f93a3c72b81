"""What a selective block keeps for the backward and what it recomputes there, from the joint graph alone.

A block in "selective" mode (planner/plan.py) saves the outputs of the ops that are costly to run again and
recomputes the others in the backward. The tags that say so (`policy`) are read by
`passes/activations.py: checkpoint_tag_pass`, which writes them into `node.meta["recompute"]`, and by
`mark_selective`, which tells the cost model what they will cost before any partition is made:

  kept (CheckpointPolicy.MUST_SAVE): library kernels, which cost arithmetic, not just memory traffic: matrix
      products, attention, convolutions (`fusion.is_matmul`), and the other ops inductor runs as a library or
      fallback kernel (`fusion.is_library`); and the block's outputs (what a later block or the loss reads), so
      that the next block's saves do not depend on this block's mode;
  recomputed (CheckpointPolicy.PREFER_RECOMPUTE): everything else: norms, activations, casts, elementwise ops,
      views, random ops (dropout: replayed from the forward's RNG state, as a checkpointed block's are).

AOTAutograd's min-cut partitioner never saves a node tagged for recompute and never recomputes one tagged
MUST_SAVE, so inside the block its choice is fixed: a kept node is saved where the backward reads it, directly or
through a recomputed node; a recomputed node runs again where the backward reads it. `selective_marks` follows
those reads back from the backward nodes of the joint graph:

    joint:  n = norm(x); h = mm(n, w1); a = gelu(h); o = mm(a, w2); y = add(x, o)     # y: the block's output
    bw:     ... mm(a.t(), do) ... gelu_backward(da, h) ... mm(n.t(), dh) ... norm_backward(dn, x, ...)
    marks:  h kept, y kept (the next block's backward reads it), a and n recomputed (from h, from x); o unread

Values the recomputed ops read from outside the block (the block's input, a rotary table, an attention mask)
stay the partitioner's choice, as with no selective block: the block's input is saved anyway (its norm's
backward reads it), a mask or a table is shared by every block.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, MutableMapping

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from protrain_fx.profiler.fusion import is_library, is_matmul
from protrain_fx.shapes import Sizes, size_at

KEEP, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def _is_backward(node: fx.Node) -> bool:
    """A joint-graph node of the backward (AOTAutograd's tag; capture.is_backward, which this layer may not
    import)."""
    return node.meta.get("partitioner_tag") == "is_backward"


def costly(node: fx.Node) -> bool:
    """Whether a selective block keeps this op's output: a library kernel (a matmul or attention even where it is
    random: its dropout is inside the kernel, and a saved output needs no replay), but no other random op (a
    mask is cheap to draw again) and no view (it costs nothing). An item of a tuple goes with its op."""
    target = node.target
    if target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and costly(node.args[0])
    if getattr(target, "is_view", False):
        return False
    if is_matmul(str(target)):
        return True
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return is_library(target)


def _leaves_block(node: fx.Node, block: int, block_of: Mapping[str, int | None]) -> bool:
    """A forward value read outside its block (the next block, the loss, the graph's outputs)."""
    return any(not _is_backward(u) and (u.op == "output" or block_of.get(u.name) != block) for u in node.users)


def policy(node: fx.Node, block: int, block_of: Mapping[str, int | None]) -> CheckpointPolicy:
    """The tag of a forward op of selective block `block` (see the module docstring)."""
    return KEEP if costly(node) or _leaves_block(node, block, block_of) else RECOMPUTE


@dataclasses.dataclass(frozen=True)
class SelectiveMarks:
    """Per forward node name: the bytes a selective block keeps of its output (each storage once, on the node
    that made it), and the nodes a selective block recomputes in the backward."""

    kept_bytes: dict[str, int]
    recomputed: frozenset[str]


def _storage_bytes(node: fx.Node, sizes: Sizes | None) -> int:
    val = node.meta.get("val")
    return size_at(val.untyped_storage().nbytes(), sizes) if isinstance(val, torch.Tensor) else 0


def _base(node: fx.Node) -> fx.Node:
    """The node whose storage `node` views (itself for others)."""
    while getattr(node.target, "is_view", False) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def selective_marks(
    joint: fx.Graph, block_of: Mapping[str, int | None], region: Mapping[str, str], sizes: Sizes | None = None
) -> SelectiveMarks:
    """What every block would keep and recompute in "selective" mode (each block's figures hold whatever the
    others' modes: a block's outputs are kept, so no block's saves depend on its neighbours), in bytes at the
    graph's symbolic `sizes` (their hints if None)."""
    in_block = {
        n: block_of[n.name]
        for n in joint.nodes
        if n.op == "call_function" and not _is_backward(n) and region.get(n.name) == "block"
    }
    stack = [a for n in joint.nodes if _is_backward(n) for a in n.all_input_nodes if not _is_backward(a)]
    seen: set[fx.Node] = set()
    kept: dict[str, int] = {}
    recomputed: set[str] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        block = in_block.get(node)
        if block is None:
            continue  # outside the blocks: the partitioner's choice (module docstring)
        if policy(node, block, block_of) is KEEP:
            base = _base(node)
            if in_block.get(base) == block:  # (a view of a parameter, an input or another block's value: not its own)
                kept.setdefault(base.name, _storage_bytes(base, sizes))
        else:
            recomputed.add(node.name)
            stack.extend(node.all_input_nodes)
    return SelectiveMarks(kept_bytes=kept, recomputed=frozenset(recomputed))


def mark_selective(records: MutableMapping[str, object], marks: SelectiveMarks) -> None:
    """Write the marks into the forward `NodeProfile`s of `records` (by name): `kept_bytes`, `recomputed`."""
    for name, record in records.items():
        record.kept_bytes = marks.kept_bytes.get(name, 0)
        record.recomputed = name in marks.recomputed
