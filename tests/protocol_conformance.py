"""Read by the type checker, never run ([tool.mypy] files, tests/test_typecheck.py): the run-time objects the backend
hands the passes meet the Protocols the pass context types them with (passes/contract.py), which stand in for them
because the passes import nothing of runtime/, debug/ or backend/ (tests/test_layering.py). A change to one of these
objects that a pass would trip over fails here, naming the member."""

from __future__ import annotations

from protrain_fx.backend.record import GraphRecord
from protrain_fx.debug.dump import Dumper
from protrain_fx.passes.contract import ChunkManagerLike, DumperLike, GraphRecordLike, StepMonitorLike, SwapSpaceLike
from protrain_fx.runtime.chunks import ChunkManager
from protrain_fx.runtime.chunks.gather import ChunkSource
from protrain_fx.runtime.chunks.outside import ChunkValues
from protrain_fx.runtime.chunks.placement import PlacedChunks
from protrain_fx.runtime.monitor import StepMonitor
from protrain_fx.runtime.swap import SwapSpace


def chunk_manager(manager: ChunkManager) -> ChunkManagerLike:
    return manager


def chunk_source(manager: ChunkManager) -> ChunkSource:  # (what the manager's Gatherer reads of it)
    return manager


def chunk_values(manager: ChunkManager) -> ChunkValues:  # (what the manager's Outside reads of it)
    return manager


def placed_chunks(manager: ChunkManager) -> PlacedChunks:  # (what the manager's ChunkPlacement reads of it)
    return manager


def swap_space(space: SwapSpace) -> SwapSpaceLike:
    return space


def step_monitor(monitor: StepMonitor) -> StepMonitorLike:
    return monitor


def graph_record(record: GraphRecord) -> GraphRecordLike:
    return record


def dumper(dumper: Dumper) -> DumperLike:
    return dumper
