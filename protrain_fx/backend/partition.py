"""`Partitioner`: our stages, run on AOTAutograd's joint graph in place of its partitioner. `__call__` is the flow of
one training graph, one named stage a line (docs/design.md):

    capture -> partition -> profile -> plan -> rewrite -> attach runtime -> dump
    (stages.py)  (min-cut)   (stages.py) (planning.py) (stages.py)  (stages.py)  (stages.py)

The profile and the plan may come from the plan cache of an earlier run (cache.py), opened before the profile;
each long phase logs one line (phases.py).

The partition is AOTAutograd's min-cut rematerialization partitioner, as inductor calls it; the rewrite cuts the
joint graph again where the plan recomputes blocks.
"""

from __future__ import annotations

import time

from torch import fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from protrain_fx.backend.cache import open_cache, source_digest
from protrain_fx.backend.phases import phase_done
from protrain_fx.backend.planning import check_states_fit, plan
from protrain_fx.backend.record import GraphCompile
from protrain_fx.backend.stages import (
    attach_runtime,
    capture,
    chunks_built,
    dump,
    dump_plan,
    open_dump,
    profile,
    rewrite,
    runtime_for,
)


class Partitioner(CustomPartitionerFn):
    """The partitioner of one compile of one graph (`compiling`), which inductor or AOTAutograd call with the joint
    graph; it keeps the graph and its inputs until `forget`."""

    def __init__(self, compiling: GraphCompile):
        self.compiling: GraphCompile | None = compiling

    def uuid(self) -> None:
        return None  # never cache: each compile profiles its own graph

    def forget(self) -> None:
        """Drop the graph and its inputs (the model's parameters among them) once the compile is done."""
        self.compiling = None

    def __deepcopy__(self, memo):
        return self  # inductor copies its config, which holds us; our inputs are real tensors, not copyable

    def __reduce__(self):
        """Pickled (inductor's FX graph cache hashes its config, which holds us) as the package's source alone: the
        graphs inductor compiles come rewritten, plan and runtime handles in them, so they key themselves; our
        lowerings are in the source. Unpickled, a partitioner whose compile is done."""
        return _done_partitioner, (source_digest(),)

    def __call__(self, joint: fx.GraphModule, joint_inputs, **kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The flow of one graph, stage by stage: forward and backward, rewritten for the plan."""
        c = self.compiling
        assert c is not None, f"the partitioner of {joint} ran after its compile was done"
        record = c.record

        def cut(graph: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
            return min_cut_rematerialization_partition(graph, joint_inputs, **kwargs)

        roots = capture(c, joint)
        dumper = open_dump(c, joint)
        fw, bw = cut(joint)
        manager = chunks_built(c, roots)
        phase_done(record.index, "capture", time.perf_counter() - c.started)
        if record.profile is None:  # (a re-plan after running out of memory reuses the graph's profile)
            record.cache = open_cache(c, joint, manager)
            check_states_fit(c, manager)
            profile(c, joint, fw, bw, manager, roots.model)
        manager = plan(c, roots, manager, (fw, bw))
        if dumper and c.switching is None:  # (a re-plan's plan goes to replan.json, beside the first)
            dump_plan(dumper, record, fw, bw)
        if c.explain and manager is None:
            record.forward, record.backward = fw, bw
            return fw, bw
        # (a prepared model's graphs are rewritten even to explain: its offloaded parameters hold no values, so
        # the forward that compiling runs needs its chunks gathered)
        runtime = runtime_for(c, roots, manager)
        fw, bw = rewrite(c, joint, (fw, bw), runtime, cut)
        attach_runtime(c, runtime, fw, bw)
        record.forward, record.backward = fw, bw
        dump(record)
        c.partitioned = time.perf_counter()
        return fw, bw


def _done_partitioner(source: str) -> Partitioner:
    """A partitioner that has forgotten its compile (`Partitioner.__reduce__`)."""
    done = Partitioner.__new__(Partitioner)
    done.compiling = None
    return done
