"""The planner run again on a dump: the plan a graph gets from the current cost models and search, from what its
dump directory holds (profile.json, planning.json, graphs.json), with no model, no device and no profiling.

    plan = plan_from_dump("dumps/rank0/graph0")                    # the dumped graph's forced fields
    plan = plan_from_dump("dumps/rank0/graph0", {"n_persist": 4})  # other forced fields
    plan = plan_from_dump(folder, host_scale=host_scale_of(folder)) # with the host AdamW as fast as in training
    python -m bench from-dump dumps/                               # every graph below, against its measured steps

So a change to the cost models can be checked against steps measured earlier (predicted_vs_measured.json, beside
them in the dump) without the machine that measured them: keep the dumps of a `bench predict` run
(`--keep-dumps`), then plan them again after each change.

planning.json holds what `CostModel.build` and `plan_graph` read besides the profile (planner/inputs.py:
`PlanningInputs`): the block count, the chunk layout and the block of each of its slots, the backward's gradient
outputs, whether the graphs run fused (inductor), the swap interval and the other bytes the backend settled on,
the GPU and host capacities the search ran under, the fields forced, and the hardware profile. graphs.json holds
the forward and backward graphs as profiled (`profiler/fusion.py: describe`): each node's kernel class and fused
bytes are classified again from them by the current `profiler/fusion.py`, so a change there is checked the same way.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protrain_fx.debug.dump import GRAPHS_FILE, PLANNING_FILE
from protrain_fx.planner.cost import Candidate
from protrain_fx.planner.inputs import PlanningInputs, cost_model
from protrain_fx.planner.plan import Plan, decisions
from protrain_fx.planner.search import plan_graph
from protrain_fx.profiler.fusion import classify, rebuild
from protrain_fx.profiler.profile import GraphProfile
from protrain_fx.runtime import monitor


def plan_from_dump(
    graph_dir: str | Path, forced: Mapping[str, Any] | None = None, *, host_scale: float | None = None
) -> Plan:
    """The plan of the graph dumped in `graph_dir` (a `rank<r>/graph<k>` folder of a dump), searched by the
    current planner under the dumped capacities; `forced`: plan fields to force instead of the dumped ones;
    `host_scale`: the dumped hardware profile's host work taken as that many times as long
    (`HardwareProfile.host_slower`), e.g. as training measured it (`host_scale_of`), to tell the host's part of
    an error from the rest."""
    profile, inputs = read_dump(graph_dir)
    fields = inputs.forced if forced is None else forced
    if host_scale is not None:
        inputs = dataclasses.replace(inputs, hardware=inputs.hardware.host_slower(host_scale))
    costs = cost_model(profile, inputs, fields)
    return plan_graph(costs, fields, inputs.layout, inputs.capacity_bytes, inputs.host_bytes)


def host_scale_of(graph_dir: str | Path) -> float | None:
    """How many times as long the host AdamW took in the steps measured in `graph_dir` as the dumped plan's
    prediction had it (`runtime/monitor.py: host_scale` of its predicted_vs_measured.json). A report written
    before the prediction was kept gets it from the dumped plan timed again by the current cost model. None
    without a measured host rate."""
    folder = Path(graph_dir)
    measured = folder / "predicted_vs_measured.json"
    report = json.loads(measured.read_text()) if measured.is_file() else {}
    if report.get("measured_host_adam_s_per_param") and not report.get("predicted_host_adam_s_per_param"):
        dumped = decisions(json.loads((folder / "plan.json").read_text()))
        profile, inputs = read_dump(folder)
        costs = cost_model(profile, inputs, dumped)
        # (older dumps: no n_selective, no n_device_shard)
        config = Candidate(**{f.name: dumped.get(f.name, 0) for f in dataclasses.fields(Candidate)})
        report["predicted_host_adam_s_per_param"] = costs.host_adam_mean_s(config)
    return monitor.host_scale(report)


def read_dump(folder: str | Path) -> tuple[GraphProfile, PlanningInputs]:
    """A graph folder's profile (its nodes classified again by the current code where graphs.json is there) and
    planning inputs (planning.json)."""
    folder = Path(folder)
    missing = [f for f in ("profile.json", PLANNING_FILE) if not (folder / f).is_file()]
    if missing:
        raise ValueError(
            f"{folder} has no {' or '.join(missing)}: pass a graph folder (rank<r>/graph<k>) of a dump written "
            "with options={'dump_dir': ...} by a protrain_fx that writes planning.json"
        )
    profile = GraphProfile.from_json(json.loads((folder / "profile.json").read_text()))
    if (folder / GRAPHS_FILE).is_file():
        profile = classified_again(profile, json.loads((folder / GRAPHS_FILE).read_text()))
    return profile, PlanningInputs.from_json(json.loads((folder / PLANNING_FILE).read_text()))


def classified_again(profile: GraphProfile, graphs: Mapping[str, list[dict]]) -> GraphProfile:
    """The profile with each node's kernel class, fused bytes and unfused bytes from the current
    `profiler/fusion.py`, run on the graphs as profiled (graphs.json)."""
    nodes = [dataclasses.replace(n) for n in profile.nodes]
    for kind in ("forward", "backward"):
        named = {n.name: n for n in nodes if n.graph == kind}
        classify(named, rebuild(graphs[kind]), cpu=profile.device.startswith("cpu"))
    return dataclasses.replace(profile, nodes=nodes)
