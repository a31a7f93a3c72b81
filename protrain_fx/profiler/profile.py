"""The profile: plain, JSON-serializable records of one measured training iteration of one graph."""

from __future__ import annotations

import csv
import dataclasses
import io
from typing import Any


@dataclasses.dataclass
class NodeProfile:
    """What one FX node cost in the profiled iteration.

    intra_delta_bytes: peak allocated during the op minus allocated just before it (transient spike).
    inter_delta_bytes: peak allocated between the previous node's end and this node's start, minus
        allocated at the previous node's end (memory used by work outside the nodes, e.g. frees and
        anything the interpreter does between ops).
    output_bytes: bytes of new storages the op returned (views of inputs count 0).
    kernel, fused_bytes, unfused_bytes: what inductor makes of the node, from the graph alone (profiler/fusion.py).
    saved_bytes: bytes of this node's output kept for backward (forward nodes; 0 elsewhere).
    needed_from_block: of a saved forward node, the highest block whose backward reads it: the backward needs it
        from that block on (None: no block's reads it).
    kept_bytes, recomputed: were its block "selective" (profiler/selective.py), the bytes of this forward node's
        output kept for backward (each storage once), and whether the backward computes it again.
    """

    name: str
    target: str
    graph: str  # forward | backward
    region: str  # pre | block | post | outside
    block: int | None
    latency_s: float
    allocated_before: int
    intra_delta_bytes: int
    inter_delta_bytes: int
    output_bytes: int
    saved_for_backward: bool = False
    saved_bytes: int = 0
    needed_from_block: int | None = None
    kernel: str = "extern"  # under a fusing executor: extern | fused | view (profiler/fusion.py)
    fused_bytes: int = 0  # bytes the fused region this node ends moves (0 unless it ends one)
    unfused_bytes: int = 0  # bytes held here op by op that fused kernels never allocate
    kept_bytes: int = 0  # kept for backward in a selective block
    recomputed: bool = False  # computed again in the backward of a selective block


@dataclasses.dataclass
class BlockProfile:
    """Per transformer block totals."""

    block: int
    forward_s: float = 0.0
    backward_s: float = 0.0
    saved_bytes: int = 0
    max_transient_bytes: int = 0


@dataclasses.dataclass
class GraphProfile:
    """One measured forward + backward iteration of one compiled graph."""

    device: str
    forward_s: float
    backward_s: float
    peak_bytes: int  # highest allocated during the iteration (allocator peak on CUDA, tracker peak on CPU)
    baseline_bytes: int  # allocated before the forward started (parameters, inputs, ...)
    saved_bytes: int  # activation bytes kept from forward to backward (parameters and inputs excluded)
    nodes: list[NodeProfile]
    blocks: list[BlockProfile]
    reserved_bytes: int = 0  # the allocator's reserved bytes after the memory run, begun on an empty cache (0 on CPU)
    # what was allocated at most in fact: less than peak_bytes where tensors were held on demand (on_demand.py)
    measured_peak_bytes: int = 0
    # the matmuls' least time in the timed runs over their time at the clocks of a short burst, which their
    # latency_s is (profiler/interpreter.py `least_at_burst_clocks`; 1 on the CPU)
    matmul_clock_stretch: float = 1.0
    # how far the timed runs spread above each node's least: their nodes' median times summed over the least times
    # summed, less one (profiler/interpreter.py; 0 in a profile written before it was kept)
    timing_noise: float = 0.0

    @property
    def fragmentation(self) -> float:
        """Reserved over peak allocated bytes of the profiled iteration (1 on the CPU): the memory model's α."""
        peak = self.measured_peak_bytes or self.peak_bytes
        return max(1.0, self.reserved_bytes / peak) if self.reserved_bytes and peak else 1.0

    @property
    def iteration_s(self) -> float:
        return self.forward_s + self.backward_s

    def node(self, name: str, graph: str) -> NodeProfile:
        return next(n for n in self.nodes if n.name == name and n.graph == graph)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GraphProfile:
        data = dict(data)
        data["nodes"] = [NodeProfile(**n) for n in data["nodes"]]
        data["blocks"] = [BlockProfile(**b) for b in data["blocks"]]
        return cls(**data)

    def to_csv(self) -> str:
        buf = io.StringIO()
        fields = [f.name for f in dataclasses.fields(NodeProfile)]
        writer = csv.DictWriter(buf, fieldnames=fields)
        writer.writeheader()
        for node in self.nodes:
            writer.writerow(dataclasses.asdict(node))
        return buf.getvalue()


def aggregate_blocks(nodes: list[NodeProfile]) -> list[BlockProfile]:
    """Sum node profiles into per-block totals, in block order."""
    blocks: dict[int, BlockProfile] = {}
    for node in nodes:
        if node.block is None:
            continue
        b = blocks.setdefault(node.block, BlockProfile(block=node.block))
        if node.graph == "forward":
            b.forward_s += node.latency_s
            b.saved_bytes += node.saved_bytes
        else:
            b.backward_s += node.latency_s
        b.max_transient_bytes = max(b.max_transient_bytes, node.intra_delta_bytes)
    return [blocks[k] for k in sorted(blocks)]
