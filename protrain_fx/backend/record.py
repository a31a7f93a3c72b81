"""What the backend's stages read and write about one graph: `GraphRecord` (kept for inspection after the compile),
`GraphCompile` (one compile of the graph, as its stages see it) and the attributes the backend keeps on the model."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from protrain_fx.capture import BlockMap, ParamEntry
from protrain_fx.config import ProTrainConfig
from protrain_fx.planner.inputs import PlanningInputs
from protrain_fx.planner.plan import Plan
from protrain_fx.profiler.profile import GraphProfile

RUNTIME_ATTR = "_protrain_runtime"  # on the model: the swap spaces and step monitors of its graphs
# on the model: (parameters read, Plan, ShapeRange or None, what came from the plan cache) of each graph compiled
# for training
PLANS_ATTR = "_protrain_plans"


@dataclasses.dataclass
class GraphRecord:
    """Everything the backend learned and decided about one compiled graph, kept for inspection."""

    index: int
    param_map: dict[str, ParamEntry] = dataclasses.field(default_factory=dict)
    block_map: BlockMap | None = None
    profile: GraphProfile | None = None
    plan: Plan | None = None
    costs: Any = None  # the CostModel the plan was searched with (planner/cost.py)
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    swap: Any = None  # the SwapSpace of its swapped activations (runtime/swap.py), None when no block swaps
    monitor: Any = None  # its StepMonitor (runtime/monitor.py): with a dump directory, or to re-plan it
    capacity: int | None = None  # the GPU bytes its plan was searched under (None: not budgeted, on the CPU)
    model: Any = None  # weak reference to the model whose graph it is
    manager: Any = None  # weak reference to the model's ChunkManager, None when not chunked
    grad_source: int | None = None  # its frame's id for the ChunkManager (runtime/chunks/arrivals.py)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # wall time of profile, hardware, search
    planning: PlanningInputs | None = None  # the planner's inputs besides the profile (a dump's planning.json)
    dumper: Any = None  # its Dumper (debug/dump.py), where dumped: a re-plan's files go beside the first plan's
    # a graph with symbolic sizes: its symbols (backend/sizes.py: GraphSizes), its profile at any sizes
    # (profiler/scaling.py: ProfileFit), and the sizes its plan covers (shapes.py: ShapeRange); None otherwise
    sizes: Any = None
    fit: Any = None
    shapes: Any = None
    key: object = dataclasses.field(default_factory=object, repr=False)  # the graph's, among those reading chunks
    cache: Any = None  # its entry in the plan cache (backend/cache.py: GraphCache), None with the cache off
    # what came from the cache of an earlier run: "profile", "plan", "closed loop" (its calibration and choice)
    from_cache: tuple[str, ...] = ()


@dataclasses.dataclass
class GraphCompile:
    """One compile of one Dynamo graph, as the partitioner's stages read and write it (backend/stages.py,
    backend/planning.py). `config` is the options in force: the plan stage fills in the plan's defaults, and a
    re-plan out of memory while the chunks are built lowers its capacity."""

    config: ProTrainConfig
    record: GraphRecord
    dynamo_gm: fx.GraphModule
    example_inputs: list
    explain: bool = False  # plan only (protrain_fx.explain): no chunks built, graphs left as they are
    guard: Any = None  # the training graph's Guarded (backend/guard.py); None to explain, or under no_grad
    device: torch.device = dataclasses.field(init=False)
    started: float = dataclasses.field(default_factory=time.perf_counter)  # when the compile began (its phase lines)
    partitioned: float | None = None  # when the partitioner returned the rewritten graphs

    def __post_init__(self) -> None:
        self.device = device_of(self.example_inputs)

    @property
    def fakes(self) -> list:
        """The compile-time value of each input (a fake tensor, a SymInt), as Dynamo's placeholders hold them."""
        return [n.meta.get("example_value") for n in self.dynamo_gm.graph.find_nodes(op="placeholder")]

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters the graph reads, in the order of its parameter map (capture fills it)."""
        return [self.example_inputs[e.index] for e in self.record.param_map.values()]

    @property
    def switching(self):
        """The plan and cost model a re-plan from the measured steps puts in force (runtime/replan.py), or None."""
        return self.guard.switching if self.guard is not None else None

    @property
    def loop(self):
        """The graph's ClosedLoop (runtime/replan.py), None unless it may re-plan from the measured steps."""
        return self.guard.loop if self.guard is not None else None


def device_of(example_inputs: Sequence[Any]) -> torch.device:
    return next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
