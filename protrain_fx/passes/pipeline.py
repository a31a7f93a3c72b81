"""The pass pipeline: one ordered list per stage, each pass `fn(gm, ctx) -> gm`.

A pass reads its decisions from `ctx` (the plan, the chunk manager, the capture record) and tags in `node.meta`;
a pass with nothing to do returns the graph unchanged. Each pass declares the graphs it rewrites, the context
fields and tags it requires and the tags it provides (passes/contract.py `graph_pass`), and each list is checked
against those declarations as it is built here (`check_order`): a pass before the one whose tags it reads, or run
on a context without a field it reads, fails at import; and `run_passes` hands each pass a context that refuses the
fields it does not declare. Stages:
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
from collections.abc import Sequence

from torch import fx

from protrain_fx.passes.activations import checkpoint_tag_pass, recompute_order_pass, swap_in_pass, swap_out_pass
from protrain_fx.passes.chunks import (
    chunk_gather_pass,
    chunk_tag_pass,
    grad_reduce_pass,
    param_view_recompute_pass,
)
from protrain_fx.passes.contract import (
    BACKWARD,
    FORWARD,
    INFERENCE,
    JOINT,
    Pass,
    PassContext,
    as_declared,
    check_order,
)
from protrain_fx.passes.monitor import step_mark_pass

__all__ = ["GRAPH_PASSES", "INFERENCE_PASSES", "JOINT_PASSES", "Pass", "PassContext", "run_passes"]

log = logging.getLogger(__name__)

JOINT_PASSES = check_order((checkpoint_tag_pass, param_view_recompute_pass), runs_on=[(JOINT, JOINT)])
GRAPH_PASSES = check_order(
    (
        recompute_order_pass,
        swap_out_pass,
        swap_in_pass,
        chunk_tag_pass,
        chunk_gather_pass,
        grad_reduce_pass,
        step_mark_pass,
    ),
    runs_on=[(FORWARD, FORWARD), (BACKWARD, BACKWARD)],
    after=JOINT_PASSES,
)
# the graph AOTAutograd compiles for inference (no_grad): offloaded parameters read through gather/release
INFERENCE_PASSES = check_order((chunk_tag_pass, chunk_gather_pass), runs_on=[(FORWARD, INFERENCE)])


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass], *, stage: str) -> fx.GraphModule:
    """Apply `passes` in order, each seeing only the context fields it requires (`as_declared`); an error names the
    failing pass and those that ran before it."""
    ctx = dataclasses.replace(ctx, stage=stage)
    done: list[str] = []
    for i, pass_fn in enumerate(passes):
        name = pass_fn.__name__
        try:
            gm = pass_fn(gm, as_declared(ctx, pass_fn))
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
