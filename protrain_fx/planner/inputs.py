"""PlanningInputs: what the planner reads about one graph besides its profile, and the cost model built from them.

    inputs = PlanningInputs(forced=..., n_block=..., layout=..., ..., hardware=hardware)
    costs = cost_model(profile, inputs)
    plan = plan_graph(costs, inputs.forced, inputs.layout, inputs.capacity_bytes, inputs.host_bytes)

The backend builds them for each graph it plans (backend/planning.py `_search`) and dumps them as planning.json;
debug/from_dump.py reads them back to plan a dumped graph again with the current code. Both get the cost model
from `cost_model`, so a dumped graph is planned again from what the backend planned it with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from protrain_fx.planner.chunking import ChunkLayout
from protrain_fx.planner.cost import CostModel
from protrain_fx.planner.plan import Plan, decisions, master_bytes
from protrain_fx.planner.search import plan_graph
from protrain_fx.profiler.hardware import HardwareProfile
from protrain_fx.profiler.profile import GraphProfile


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanningInputs:
    """What `CostModel.build` and `plan_graph` read of one graph besides its profile."""

    forced: Mapping[str, Any]  # the plan fields forced (options['plan'])
    n_block: int
    layout: ChunkLayout | None  # None: the parameters are not in chunks
    block_of_param: tuple[int | None, ...]  # the block of each of the layout's slots (None outside the blocks)
    # (chunk, block) for each time the forward gathers a chunk again (backend/planning.py `_regathers`)
    regathers: tuple[tuple[int, int], ...]
    grad_outputs: frozenset[str]  # the backward's outputs that are parameter gradients
    fused: bool  # the graphs run under inductor
    # for each n_persist, the fewest chunk buffers the graphs run with (passes/chunks.py `buffers_needed`)
    least_buffers: tuple[int, ...] = ()
    # settled by the backend from the cost model built before them (until then CostModel's defaults: `settled`)
    swap_interval: int = 1
    other_bytes: int = 0  # what the device holds besides the activations and the chunk states
    updates_wait: bool = False  # every update waits for AdamW.step() (an optimizer that skips non-finite steps)
    # the GPU and host bytes the search runs under, the least any rank has (None: not budgeted)
    capacity_bytes: int | None = None
    host_bytes: int | None = None
    hardware: HardwareProfile

    def to_json(self) -> dict[str, Any]:
        """planning.json."""
        return {
            "forced": dict(self.forced),
            "n_block": self.n_block,
            "layout": self.layout.to_json() if self.layout is not None else None,
            "block_of_param": list(self.block_of_param),
            "regathers": [list(r) for r in self.regathers],
            "grad_outputs": sorted(self.grad_outputs),
            "fused": self.fused,
            "least_buffers": list(self.least_buffers),
            "swap_interval": self.swap_interval,
            "other_bytes": self.other_bytes,
            "updates_wait": self.updates_wait,
            "capacity_bytes": self.capacity_bytes,
            "host_bytes": self.host_bytes,
            "hardware": self.hardware.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanningInputs:
        return cls(
            forced=data["forced"],
            n_block=data["n_block"],
            layout=ChunkLayout.from_json(data["layout"]) if data["layout"] is not None else None,
            block_of_param=tuple(data["block_of_param"]),
            regathers=tuple(tuple(r) for r in data.get("regathers", ())),  # (a dump written before they were kept)
            grad_outputs=frozenset(data["grad_outputs"]),
            fused=data["fused"],
            least_buffers=tuple(data.get("least_buffers", ())),  # (a dump written before they were kept)
            swap_interval=data["swap_interval"],
            other_bytes=data["other_bytes"],
            updates_wait=data.get("updates_wait", False),  # (a dump written before it was kept: as then)
            capacity_bytes=data["capacity_bytes"],
            host_bytes=data["host_bytes"],
            hardware=HardwareProfile.from_json(data["hardware"]),
        )


def cost_model(profile: GraphProfile, inputs: PlanningInputs, forced: Mapping[str, Any] | None = None) -> CostModel:
    """The cost models of the graph from its profile and planning inputs, for the plan fields `forced` (their
    master dtype; default: the inputs' own)."""
    costs = CostModel.build(
        profile,
        inputs.hardware,
        n_block=inputs.n_block,
        layout=inputs.layout,
        block_of_param=inputs.block_of_param,
        regathers=inputs.regathers,
        grad_outputs=inputs.grad_outputs,
        fused=inputs.fused,
        master_bytes=master_bytes(inputs.forced if forced is None else forced),
    )
    return settled(costs, inputs)


def settled(costs: CostModel, inputs: PlanningInputs) -> CostModel:
    """`costs` with the terms the backend settles after building them: the swap interval (from the blocks' saved
    bytes and forward times), the other bytes (from the chunk states) and whether updates wait; and the chunk
    buffers the graphs need."""
    return dataclasses.replace(
        costs,
        swap_interval=inputs.swap_interval,
        other_bytes=inputs.other_bytes,
        updates_wait=inputs.updates_wait,
        least_buffers=inputs.least_buffers,
    )


def retimed(costs: CostModel, inputs: PlanningInputs, plan: Plan, hardware: HardwareProfile) -> Plan:
    """`plan` timed again, nothing searched, by `costs` (the cost model it was searched with) on `hardware`,
    under the capacities of `inputs`: e.g. with the host AdamW as fast as training measured it
    (`HardwareProfile.host_slower` by `runtime/monitor.py: host_scale`), to tell the host's part of an error
    from the rest."""
    costs = dataclasses.replace(costs, hardware=hardware)
    return plan_graph(costs, decisions(plan.to_json()), inputs.layout, inputs.capacity_bytes, inputs.host_bytes)
