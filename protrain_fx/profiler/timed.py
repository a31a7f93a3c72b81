"""Time each node of a graph (the profile's time runs, profiler/interpreter.py): a copy of the graph with a clock
mark after every node, run as compiled Python, and on CUDA probe matmuls between marks of their own that tell the
clocks the device ran at.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.graph import _BoxedCodeGen

from protrain_fx.capture import OUTSIDE, BlockMap
from protrain_fx.profiler.hardware import interpolate
from protrain_fx.profiler.microbench import IDLE_CYCLES
from protrain_fx.profiler.on_demand import CALL_OPS, Replay
from protrain_fx.profiler.profile import NodeProfile

PROBE_EVERY = 64  # timed nodes between two probes of the clocks (a `probe_matmul`: ~0.2 ms on an H200)

# time for the CPU to fill CUDA's launch queue ahead of the GPU (~0.1 s at H100/H200 clocks). A longer sleep queues
# no more (the CPU then waits for room in the queue), so nodes that the GPU runs faster than the CPU queues them
# are timed at the CPU's pace
_PREFILL_CYCLES = IDLE_CYCLES
# ~1 ms: after tensors are dropped or brought back on demand, time for the CPU to catch up with the GPU
_REFILL_CYCLES = 2_000_000


def new_record(node: fx.Node, graph_kind: str, block_map: BlockMap) -> NodeProfile:
    """A node's record, to be filled in by the run that times it (`TimedGraph`) or reads its memory
    (profiler/interpreter.py: ProfilingInterpreter)."""
    return NodeProfile(
        name=node.name,
        target=str(node.target),
        graph=graph_kind,
        region=block_map.region.get(node.name, OUTSIDE),
        block=block_map.block.get(node.name),
        latency_s=0.0,
        allocated_before=0,
        intra_delta_bytes=0,
        inter_delta_bytes=0,
        output_bytes=0,
    )


class _Clock:
    """Timestamps: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


class TimedGraph:
    """Times each node of a graph: a copy with `clock.mark()` after every node, run as compiled Python with
    boxed arguments (each freed after its last use, as AOTAutograd's runtime does).

    With a `Replay` (tensors held on demand) the drops and fetches it learned run between the nodes, each
    followed by a fresh mark, so that they stay out of the node times; after a chunk is read from the host the
    GPU's queue is refilled.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        *,
        graph_kind: str,
        block_map: BlockMap,
        device: torch.device,
        replay: Replay | None = None,
        probe: Callable[[], object] | None = None,
    ):
        self.clock = _Clock(device)
        self.replay = replay
        self.probe = probe
        graph = fx.Graph()
        graph.set_codegen(_BoxedCodeGen())
        env: dict[fx.Node, fx.Node] = {}
        named = {n.name: n for n in gm.graph.nodes}
        self.records: list[NodeProfile] = []
        self.spans: list[tuple[int, int]] = []  # per record: the marks before and after its node
        self.probe_spans: list[tuple[int, int, int]] = []  # per probe: the record it ran before, its two marks
        self.probe_s: list[tuple[int, float]] = []  # per probe in the last run: that record, its seconds
        marks = 1  # boxed_run's first

        def values(events):  # the copied nodes of (node name, tensor leaf) events
            return tuple((env[named[name]], leaf) for name, leaf in events)

        for node in gm.graph.nodes:
            i = len(self.records)
            if node.op in CALL_OPS and probe is not None and i % PROBE_EVERY == 0:
                graph.call_function(probe)
                graph.call_function(self.clock.mark)
                self.probe_spans.append((i, marks - 1, marks))
                marks += 1
            if node.op in CALL_OPS and replay is not None:
                drops, fetches = values(replay.drop_after.get(i - 1, ())), values(replay.fetch_before.get(i, ()))
                if drops or fetches:
                    graph.call_function(self._between, (drops, fetches))
                    graph.call_function(self.clock.mark)
                    marks += 1
            env[node] = graph.node_copy(node, env.__getitem__)
            if node.op in CALL_OPS:
                graph.call_function(self.clock.mark)
                self.spans.append((marks - 1, marks))
                marks += 1
                self.records.append(new_record(node, graph_kind, block_map))
        self.module = fx.GraphModule(gm, graph)

    def _between(self, drops, fetches) -> None:
        from_host = self.replay.between(drops, fetches)  # reading a chunk from the host lets the GPU's queue run dry
        if self.clock.cuda:
            torch.cuda._sleep(_PREFILL_CYCLES if from_host else _REFILL_CYCLES)

    def boxed_run(self, args: list[Any]) -> Any:
        self.clock.marks.clear()  # (a TimedGraph may run again)
        if self.clock.cuda:
            torch.cuda._sleep(_PREFILL_CYCLES)
        self.clock.mark()
        out = self.module(args)
        seconds = self.clock.intervals()
        for record, (start, end) in zip(self.records, self.spans):
            record.latency_s = sum(seconds[start:end])
        self.probe_s = [(i, sum(seconds[start:end])) for i, start, end in self.probe_spans]
        return out

    def probe_at_records(self) -> list[float]:
        """Per record, the last run's probe time there: linear between the probes around it, the last one's after
        it (one runs before the first record)."""
        if not self.probe_s:  # (a graph with no node to time)
            return [0.0] * len(self.records)
        return [interpolate(self.probe_s, i) for i in range(len(self.records))]
