"""The pass pipeline: one ordered list per stage, each pass `fn(gm, ctx) -> gm`.

A pass reads its decisions from `ctx` (the plan, the chunk manager, the capture record) and tags in `node.meta`;
a pass with nothing to do returns the graph unchanged. Stages:
  JOINT_PASSES   on the joint forward+backward graph, before it is partitioned again: the recompute tags of
                 checkpointed and selective blocks, and of the views of offloaded parameters (activations.py,
                 chunks.py)
  GRAPH_PASSES   on the partitioned forward and backward graphs: the recompute order, activation swapping
                 (activations.py), the chunk passes (chunks.py), then with a dump directory the step marks that
                 measure the plan against its predictions (monitor.py)
  INFERENCE_PASSES  on a graph compiled under no_grad of a model with offloaded chunks (the chunk passes)
With a dump directory, the graph after each pass is written as readable Python (`<stage>_<i>_<pass>.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx

from protrain_fx.config import ProTrainConfig
from protrain_fx.passes.activations import checkpoint_tag_pass, recompute_order_pass, swap_in_pass, swap_out_pass
from protrain_fx.passes.chunks import (
    chunk_gather_pass,
    chunk_tag_pass,
    grad_reduce_pass,
    param_view_recompute_pass,
)
from protrain_fx.passes.monitor import step_mark_pass
from protrain_fx.planner.plan import Plan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PassContext:
    """What every pass may read: the options, the plan and the capture record of the graph."""

    config: ProTrainConfig
    plan: Plan
    record: Any  # protrain_fx.backend.record.GraphRecord
    dumper: Any = None  # protrain_fx.debug.dump.Dumper or None
    manager: Any = None  # the model's protrain_fx.runtime.chunks.ChunkManager, None when not chunked
    example_inputs: Sequence[Any] = ()  # the graph's real inputs (parameters by position)
    stage: str = ""  # joint | forward | backward: the graph being rewritten
    forward_placeholders: Sequence[fx.Node] = ()  # the forward graph's inputs, for backward passes
    forward_outputs: Sequence[fx.Node] = ()  # the rewritten forward graph's outputs, for backward passes
    saved: frozenset[str] = frozenset()  # names of the values the forward saves for the backward
    # saved value -> the highest block whose backward reads it (capture.py BlockMap.needed_from)
    needed_from: Mapping[str, int] = dataclasses.field(default_factory=dict)
    swap: Any = None  # the graph's protrain_fx.runtime.swap.SwapSpace, None when no block swaps
    monitor: Any = None  # the graph's protrain_fx.runtime.monitor.StepMonitor, with a dump directory only
    grad_source: int = 0  # the graph's frame, as the ChunkManager counts gradients (ChunkManager.grad_source)


Pass = Callable[..., fx.GraphModule]

JOINT_PASSES: tuple[Pass, ...] = (checkpoint_tag_pass, param_view_recompute_pass)
GRAPH_PASSES: tuple[Pass, ...] = (
    recompute_order_pass,
    swap_out_pass,
    swap_in_pass,
    chunk_tag_pass,
    chunk_gather_pass,
    grad_reduce_pass,
    step_mark_pass,
)
# the graph AOTAutograd compiles for inference (no_grad): offloaded parameters read through gather/release
INFERENCE_PASSES: tuple[Pass, ...] = (chunk_tag_pass, chunk_gather_pass)


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass], *, stage: str) -> fx.GraphModule:
    """Apply `passes` in order; an error names the failing pass and those that ran before it."""
    ctx = dataclasses.replace(ctx, stage=stage)
    done: list[str] = []
    for i, pass_fn in enumerate(passes):
        name = pass_fn.__name__
        try:
            gm = pass_fn(gm, ctx)
            gm.graph.lint()
        except Exception as e:
            raise RuntimeError(
                f"protrain pass {name!r} failed on the {stage} graph (after {done or 'no passes'}): "
                f"{type(e).__name__}: {e}"
            ) from e
        done.append(name)
        if ctx.dumper is not None:
            ctx.dumper.write_text(f"{stage}_{i}_{name}.py", gm.print_readable(print_output=False))
        log.debug("%s: ran %s", stage, name)
    return gm
