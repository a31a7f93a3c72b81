"""The `protrain` torch.compile backend: capture -> profile -> plan -> passes -> executor, per Dynamo graph.

Dynamo hands each graph (with its real example inputs) to `protrain`. AOTAutograd traces the joint
forward+backward graph and calls our partitioner on it, which is where our stages run:

    joint graph --capture--> param map, block map
               --partition (min-cut, as inductor does)--> forward, backward graphs
               --profile--> one real iteration, NodeProfile on every node (tensors on demand when too large)
               --plan--> Plan --passes--> rewritten forward, backward --executor--> inductor | eager FX

With the inductor executor the partitioner is installed through inductor's `custom_partitioner_fn`
option, so everything else inductor does (its decompositions, joint-graph and post-grad passes) is
unchanged. With the eager executor, AOTAutograd runs the graphs as FX modules.
Graphs compiled without autograd (inference under `torch.no_grad()`) have no joint graph and are
compiled with no profile or plan; where the model has offloaded chunks, `InferencePasses` gives them the
forward chunk passes (their parameters hold no values).

The modules, in the order a graph meets them:

    compiler.py   protrain, ProTrainBackend: the entry; the executors (inductor, eager)
    partition.py  Partitioner: one graph's stages in order, each a function below
    stages.py     capture, chunks_built, profile, runtime_for, rewrite, attach_runtime, open_dump, dump_plan, dump
    planning.py   plan: the planner's inputs, the search, the model's chunks built or placed for the plan
    cache.py      the plan cache: each graph's profiles, searches' results and the closed loop's decision, on disk
    phases.py     one log line per long phase (capture, profile, search, compile) and the plan chosen, on rank 0
    guard.py      Guarded: a training graph as it runs; re-plans out of GPU memory, and from the measured steps
    run.py        ChunkedRun: a chunked model's graph as it runs (its parameters checked, lent at a graph break)
    inference.py  InferencePasses: inference graphs of a model with offloaded chunks
    record.py     GraphRecord (what a graph's stages decided), GraphCompile (one compile, as the stages see it)
"""

from protrain_fx.backend.compiler import MIN_TORCH, ProTrainBackend, check_torch_version, make_boxed_compiler, protrain
from protrain_fx.backend.planning import SHAPES_ATTR
from protrain_fx.backend.record import PLANS_ATTR, RUNTIME_ATTR, GraphRecord

__all__ = [
    "GraphRecord",
    "MIN_TORCH",
    "PLANS_ATTR",
    "ProTrainBackend",
    "RUNTIME_ATTR",
    "SHAPES_ATTR",
    "check_torch_version",
    "make_boxed_compiler",
    "protrain",
]
