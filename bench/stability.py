"""`python -m bench stability`: how far one model's plan and its predicted step move between profiles of it.

    python -m bench stability --profiles 2 --preset 5.5b --family qwen2 --gpu-memory-gib 79.6
    python -m bench stability --dumps out/dumps/plan0 out/dumps/plan1 --plans '[{"n_persist": 12}]'

`--profiles N` profiles the model N times, each in a worker process of its own (`python -m bench profile`: a fresh
compile by the protrain backend in explain mode, which profiles and plans the graph and trains nothing), each with a
dump directory; `--remeasure-hardware` has each measure the hardware profile again instead of reading this machine's
cache. `--dumps` reads the dump directories of earlier runs of one model instead: each run of `bench predict
--keep-dumps` profiled the model afresh, so its dumps are as many profiles at no further cost.

Each dumped graph is then planned again from its files (`debug/from_dump.py`), and the report gives, per graph: each
profile's forward and backward time, timing noise, α and host AdamW rate; the plan the search chose from each
profile; the predicted step of the same plans in every profile (the first profile's searched plan and each of
`--plans`), their spread (the most over the least, less one) and the spread with every profile planned on the
first profile's hardware profile, so that the graph profiles' part of it shows apart from the hardware profiles'.
`--capacities 1,0.7,0.4` plans every profile again under those capacities too, each a share of the way from the
least any plan needs to what every chunk persistent needs (as the first profile predicts them): where the search
has choices to make.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.table import table
from protrain_fx.debug.dump import PLANNING_FILE
from protrain_fx.debug.from_dump import read_dump
from protrain_fx.planner.cost import Candidate, CostModel
from protrain_fx.planner.inputs import PlanningInputs, cost_model
from protrain_fx.planner.plan import Plan
from protrain_fx.planner.search import SEARCHED, candidates, plan_graph
from protrain_fx.profiler.hardware import HardwareProfile
from protrain_fx.profiler.profile import GraphProfile

log = logging.getLogger(__name__)


def stability(args: argparse.Namespace) -> int:
    from bench.cli import _git_commit

    plans = json.loads(args.plans)  # (a list of plan dicts: bench/cli.py checks it)
    fractions = [float(f) for f in args.capacities.split(",")] if args.capacities else []
    with tempfile.TemporaryDirectory(prefix="protrain-stability-") as tmp:
        if args.dumps:
            dumps, results = [Path(d) for d in args.dumps], []
        else:
            if args.profiles < 2:
                raise SystemExit(f"need --profiles >= 2 to compare profiles, got {args.profiles}")
            root = Path(args.keep_dumps or tmp)
            dumps = [root / f"profile{i}" for i in range(args.profiles)]
            results = [_run_profile(args, dump) for dump in dumps]
            failed = [r["error"] for r in results if "error" in r]
            if failed:
                log.error("profiling failed: %s", "; ".join(failed))
                return 1
        reports = [analyse(graph, folders, plans, fractions) for graph, folders in graph_folders(dumps).items()]
    if not reports:
        raise SystemExit(f"no graph dumped with profile.json and {PLANNING_FILE} in every one of {dumps}")
    print("\n\n".join(format_report(r) for r in reports))
    if args.out:
        args_out = {k: v for k, v in vars(args).items() if k != "func"}
        report = {"commit": _git_commit(), "args": args_out, "profiles": results, "graphs": reports}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _run_profile(args: argparse.Namespace, dump: Path) -> dict:
    """One profile of the model, in a worker process of its own (`profile_worker`), dumped into `dump`."""
    from bench.cli import run_for_result, worker_flags

    run = argparse.Namespace(**{**vars(args), "dump_dir": str(dump), "plan": "{}"})
    cmd = [sys.executable, "-m", "bench", "profile", *worker_flags(run)]
    return run_for_result(cmd + (["--remeasure-hardware"] if args.remeasure_hardware else []), "profile")


def profile_worker(args: argparse.Namespace) -> int:
    """`python -m bench profile`: the model profiled and planned once by the protrain backend in explain mode,
    into `--dump-dir`; emits the plan (started by `stability`)."""
    import torch

    import protrain_fx
    from bench.model import DTYPES, ModelSpec, build_prepared_model, random_batches, resolve_init
    from bench.worker import emit, limit_gpu_memory
    from protrain_fx.profiler.hardware import hardware_profile

    spec = ModelSpec.from_args(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    limit = int(args.gpu_memory_gib * 2**30)
    if limit > 0:
        limit_gpu_memory(device, limit)
    if args.remeasure_hardware:  # (into this machine's cache, where the backend then reads it)
        hardware_profile(device, remeasure=True)
    options: dict[str, Any] = {"dump_dir": args.dump_dir, "executor": args.executor}
    if limit > 0:
        options["gpu_memory_bytes"] = limit
    init = resolve_init(args.init, True, spec, DTYPES[args.dtype], device, limit)
    model = build_prepared_model(spec, device, DTYPES[args.dtype], args.seed, init)
    [ids] = random_batches(spec, args.batch, 1, device, args.seed)
    plan = protrain_fx.explain(model, {"input_ids": ids, "labels": ids}, options)
    emit({"system": "profile", "dump_dir": args.dump_dir, "plan": _fields(plan.to_json())})
    return 0


def graph_folders(dumps: list[Path]) -> dict[str, list[Path]]:
    """Per graph (`rank0/graph<k>`) dumped in every one of `dumps` with a profile and planning.json: its folder in
    each dump, in the order of `dumps`."""
    found = [{f.parent.name: f.parent for f in dump.glob(f"rank0/graph*/{PLANNING_FILE}")} for dump in dumps]
    names = sorted(set.intersection(*(set(f) for f in found)) if found else set())
    return {n: [f[n] for f in found] for n in names if all((f[n] / "profile.json").is_file() for f in found)}


@dataclasses.dataclass
class _Dumped:
    """One profile's dump of a graph, as `read_dump` gives it."""

    folder: Path
    profile: GraphProfile
    inputs: PlanningInputs

    def costs(self, forced: dict, hardware: HardwareProfile | None = None) -> CostModel:
        inputs = self.inputs if hardware is None else dataclasses.replace(self.inputs, hardware=hardware)
        return cost_model(self.profile, inputs, forced)

    def plan(self, forced: dict, capacity: int | None = None, hardware: HardwareProfile | None = None) -> Plan:
        """Planned again with the plan fields `forced`, under `capacity` (the dumped one where None)."""
        capacity = self.inputs.capacity_bytes if capacity is None else capacity
        return plan_graph(self.costs(forced, hardware), forced, self.inputs.layout, capacity, self.inputs.host_bytes)


def analyse(graph: str, folders: list[Path], plans: list[dict], fractions: list[float]) -> dict:
    """The report of one graph over its profiles (`folders`, one dump each): see the module docstring."""
    dumped = [_Dumped(folder, *read_dump(folder)) for folder in folders]
    first_hardware = dumped[0].inputs.hardware
    searched = [d.plan({}) for d in dumped]
    timed = [_fields(searched[0].to_json()), *plans]
    rows = []
    for d, plan in zip(dumped, searched):
        hardware = d.inputs.hardware
        rows.append(
            {
                "dump": str(d.folder),
                "forward_s": d.profile.forward_s,
                "backward_s": d.profile.backward_s,
                "timing_noise": d.profile.timing_noise,
                "alpha": d.profile.fragmentation,
                "host_adam_s_per_param": hardware.host_adam_s_per_param,
                "h2d_bytes_per_s": hardware.h2d_bytes_per_s,
                "searched": _fields(plan.to_json()),
                "searched_step_s": plan.predicted_step_s,
                "forced_step_s": [d.plan(dict(p)).predicted_step_s for p in timed],
                "forced_step_s_at_first_hardware": [
                    d.plan(dict(p), hardware=first_hardware).predicted_step_s for p in timed
                ],
            }
        )
    report = {
        "graph": graph,
        "profiles": rows,
        "plans": timed,
        "searched_changed": _changed(r["searched"] for r in rows),
    }
    report["spread"] = [_spread([r["forced_step_s"][i] for r in rows]) for i in range(len(timed))]
    report["spread_at_first_hardware"] = [
        _spread([r["forced_step_s_at_first_hardware"][i] for r in rows]) for i in range(len(timed))
    ]
    if fractions and dumped[0].inputs.layout is not None:
        report["capacities"] = [_at_capacity(dumped, capacity) for capacity in capacities(dumped[0], fractions)]
    return report


def capacities(dumped: _Dumped, fractions: list[float]) -> list[int]:
    """GPU capacities each `fractions` of the way from the least any plan needs to what every chunk persistent
    needs (predicted reserved bytes, by `dumped`'s profile)."""
    costs = dumped.costs({})
    everything = costs.reserved_bytes(Candidate(costs.n_chunk))
    least = min(costs.reserved_bytes(row[0]) for row in candidates(costs, {}) if row)  # (rows grow in memory)
    return [int(least + (everything - least) * f) for f in fractions]


def _at_capacity(dumped: list[_Dumped], capacity: int) -> dict:
    plans = [d.plan({}, capacity) for d in dumped]
    fields = [_fields(p.to_json()) for p in plans]
    return {
        "capacity_bytes": capacity,
        "searched": fields,
        "searched_step_s": [p.predicted_step_s for p in plans],
        "changed": _changed(fields),
    }


def _fields(plan: dict) -> dict:
    return {k: plan[k] for k in SEARCHED if k in plan}


def _changed(fields) -> bool:
    return len({json.dumps(f, sort_keys=True) for f in fields}) > 1


def _spread(times: list[float]) -> float:
    return max(times) / min(times) - 1 if min(times) > 0 else 0.0


def _label(fields: dict) -> str:
    return "/".join(str(fields.get(k, "-")) for k in SEARCHED)


def format_report(report: dict) -> str:
    """The report of one graph as text: a row per profile, then the spreads and whether the searched plan changed."""
    plans = report["plans"]
    header = ("profile", "fwd ms", "bwd ms", "noise", "alpha", "host ns/param", "searched", "pred ms")
    header += tuple(f"{_label(p)} ms" for p in plans)
    lines = [header]
    for r in report["profiles"]:
        lines.append(
            (
                r["dump"],
                f"{r['forward_s'] * 1e3:.2f}",
                f"{r['backward_s'] * 1e3:.2f}",
                f"{r['timing_noise']:.1%}",
                f"{r['alpha']:.3f}",
                f"{r['host_adam_s_per_param'] * 1e9:.3f}",
                _label(r["searched"]),
                f"{r['searched_step_s'] * 1e3:.2f}",
                *(f"{t * 1e3:.2f}" for t in r["forced_step_s"]),
            )
        )
    out = [f"{report['graph']}, {len(report['profiles'])} profiles (plans as {'/'.join(SEARCHED)}):", table(lines)]
    changed = "changed" if report["searched_changed"] else "the same in every profile"
    out.append(f"searched plan: {changed}")
    for i, plan in enumerate(plans):
        which = "the first profile's searched plan" if i == 0 else json.dumps(plan)
        out.append(
            f"{_label(plan)} ({which}): spread {report['spread'][i]:.1%}, "
            f"{report['spread_at_first_hardware'][i]:.1%} on the first profile's hardware profile"
        )
    for c in report.get("capacities", []):
        plans_at = ", ".join(_label(f) for f in c["searched"])
        out.append(
            f"at {c['capacity_bytes'] / 2**30:.3f} GiB: {'changed' if c['changed'] else 'the same'} ({plans_at})"
        )
    return "\n".join(out)
