"""The plan cache: what the backend measured and decided about one graph, kept on disk for the next run.

    $PROTRAIN_CACHE_DIR/plans/<digest of the graph's key>.json      one entry per graph (cache_dir.py)

    cache = open_cache(c, joint, manager)          # the graph's entry, as read (None: the option plan_cache="off")
    profiles = cache.profiles(sizes)               # the profiles measured at those sizes, else None: profile
    plan = cache.search(inputs, capacities, run)   # the search's result for those inputs, else run() (and kept)
    cache.keep_loop(calibration, plan)             # the closed loop's decision, beside the first plan

An entry is found by the graph's key (`graph_key`): the joint graph's structure (each node's op, target and
arguments, its value's shape, strides and dtype, symbolic sizes as their expressions), the block and parameter
maps, the model's chunks where built already, the executor, the machine (the hardware profile's key: device and
its memory, world size, host threads, torch) and the versions of torch, transformers and protrain_fx, with a
digest of protrain_fx's source. What it holds depends on more, and is used only where that is unchanged:

    profiles   the profiles and the sizes they were measured at (a graph with symbolic sizes: two, from which its
               ProfileFit is made again): used where the sizes to measure at are these
    results    each search's result (a plan, or "no plan fits" with the error's message) under the digest of all
               the search reads (the cost model: the profile, the hardware profile, the chunk layout, the
               closed loop's calibration; the forced fields) and the GPU and host capacities it ran under: used
               where the digest is equal and each capacity within CAPACITY_SLACK of the one searched under
    loop       on the first plan's result: the closed loop's calibration and the plan it switched to (None: the
               first plan was kept), put in force at once on a relaunch whose first plan came from the cache

Whatever is not used is measured or searched again, and written back; a new profile drops the results. A file that
cannot be read (partial, corrupt, another format) is ignored with a warning. Each write is a whole entry under a
temporary name, then renamed. With several ranks a part is used only where every rank read the same (`_agreed`),
and each machine's local rank 0 writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from protrain_fx.backend.record import GraphCompile
from protrain_fx.cache_dir import default_cache_dir
from protrain_fx.distributed import same_on_every_rank, writes_machine_files
from protrain_fx.planner.calibrate import Calibration, calibrated
from protrain_fx.planner.plan import Plan
from protrain_fx.planner.search import NoPlanFits
from protrain_fx.profiler.hardware import cache_key
from protrain_fx.profiler.profile import GraphProfile
from protrain_fx.runtime.adopt import plan_fields_of

log = logging.getLogger(__name__)

FORMAT = 1  # the entry's layout: an entry of another is read as none
PLANS_DIR = "plans"
# a GPU's free memory and a host's available memory move a little between launches: a result searched under
# capacities within this share of today's is used (a plan predicted over today's GPU capacity only where it was
# over the capacity it was searched under too: forced)
CAPACITY_SLACK = 0.02
MAX_RESULTS = 8  # results kept per entry, the latest (capacities, a graph with symbolic sizes' bounds)
Sizes = Mapping[Any, int]  # a graph's symbols and their values (none for a graph of fixed sizes)


class RememberedNoPlanFits(NoPlanFits):
    """A search's NoPlanFits, from the cache: its message, none of its numbers."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)


@dataclasses.dataclass
class GraphCache:
    """One graph's entry: what was read (`entry`), used part by part, and written back whole on each change."""

    path: Path
    key: dict[str, Any]
    device: torch.device
    entry: dict[str, Any]
    first: str | None = None  # the digest of the first plan's search (None: a re-plan followed it)
    first_cached: bool = False  # that plan came from the cache

    def profiles(self, at: Sequence[Sizes]) -> list[GraphProfile] | None:
        """The profiles measured at the sizes `at` (in order), where every rank has them; else None."""
        stored = self.entry.get("profiles")
        mine = None
        if isinstance(stored, list) and [p.get("sizes") for p in stored if isinstance(p, dict)] == _sizes(at):
            mine = self._parsed("profiles", lambda: [GraphProfile.from_json(p["profile"]) for p in stored])
        return mine if _agreed(stored if mine is not None else None, self.device) else None

    def keep_profiles(self, at: Sequence[Sizes], profiles: Sequence[GraphProfile]) -> None:
        """The profiles just measured at `at`, which replace the entry's and drop its results (searched on others)."""
        self.entry["profiles"] = [{"sizes": s, "profile": p.to_json()} for s, p in zip(_sizes(at), profiles)]
        self.entry["results"] = []
        self._write()

    def search(
        self, inputs: Any, capacities: tuple[int | None, int | None], run: Callable[[], Plan], *, keep: bool
    ) -> tuple[Plan, bool]:
        """The result of the search whose inputs are `inputs` (all it reads besides the capacities, as values whose
        repr is stable) under `capacities` (GPU, host), and whether it came from the cache: from there where every
        rank has it, else `run()`, kept where `keep` (the graph's first plan; a re-plan's, under a lowered
        capacity, is not)."""
        digest = _digest(repr(inputs))
        found = self._result(digest, capacities)
        if found is not None:
            self._note_first(digest, True, keep)
            if found["plan"] is None:
                raise RememberedNoPlanFits(found["no_fit"])
            return plan_from_json(found["plan"]), True
        try:
            plan = run()
        except NoPlanFits as error:
            if keep:
                self._keep_result(
                    {"digest": digest, "capacities": list(capacities), "plan": None, "no_fit": str(error)}
                )
            raise
        if keep:
            self._keep_result({"digest": digest, "capacities": list(capacities), "plan": plan.to_json()})
        self._note_first(digest, False, keep)
        return plan, False

    def loop(self) -> dict[str, Any] | None:
        """The closed loop's decision of an earlier run, where the first plan came from the cache: {"calibration":
        Calibration, "plan": the plan switched to, or None}; else None."""
        found = self._first_result() if self.first_cached else None
        stored = found.get("loop") if found is not None else None
        if stored is None:
            return None
        return self._parsed("loop", lambda: _loop_from_json(stored))

    def keep_loop(self, calibration: Calibration, plan: Plan | None) -> None:
        """The closed loop's decision, beside the first plan it was made for: its calibration and the plan it
        switched to (None: kept the first)."""
        found = self._first_result()
        if found is None:
            return
        found["loop"] = {"calibration": calibration.to_json(), "plan": plan.to_json() if plan is not None else None}
        self._write()

    def describe(self) -> str:
        return str(self.path)

    def _note_first(self, digest: str, cached: bool, keep: bool) -> None:
        """The graph's first plan is the last found while `keep` (a graph with symbolic sizes searches bound after
        bound); a later search (a re-plan) leaves no first plan for the closed loop's decision to join."""
        self.first, self.first_cached = (digest, cached) if keep else (None, False)

    def _first_result(self) -> dict[str, Any] | None:
        return next((r for r in self._results() if r.get("digest") == self.first), None) if self.first else None

    def _results(self) -> list[dict[str, Any]]:
        results = self.entry.get("results")
        return [r for r in results if isinstance(r, dict)] if isinstance(results, list) else []

    def _result(self, digest: str, capacities: tuple[int | None, int | None]) -> dict[str, Any] | None:
        """The result under `digest`, searched under capacities near these, where every rank has it."""
        found = next((r for r in self._results() if r.get("digest") == digest), None)
        if found is not None and not self._parsed("results", lambda: _usable(found, capacities)):
            found = None
        return found if _agreed(found, self.device) else None

    def _keep_result(self, result: dict[str, Any]) -> None:
        kept = [r for r in self._results() if r.get("digest") != result["digest"]]
        self.entry["results"] = [*kept, result][-MAX_RESULTS:]
        self._write()

    def _parsed(self, part: str, parse: Callable[[], Any]) -> Any:
        """`parse()`, or None with a warning where the entry's `part` is not what this code wrote."""
        try:
            return parse()
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            log.warning("plan cache %s: its %s cannot be read (%r); ignored", self.path, part, error)
            return None

    def _write(self) -> None:
        """The entry, whole, under a temporary name then renamed (a reader sees the old file or the new one), by each
        machine's local rank 0. A cache that cannot be written is said once and training goes on."""
        if not writes_machine_files():
            return
        self.entry.update(format=FORMAT, key=self.key)
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(self.entry))
            os.replace(partial, self.path)
        except OSError as error:
            log.warning(
                "plan cache %s cannot be written (%s); the next run will profile and search again", self.path, error
            )


def searched(c: GraphCompile, inputs: Any, capacities: tuple[int | None, int | None], run: Callable[[], Plan]) -> Plan:
    """The graph's plan: `run()` (the search), or its result from the cache where `inputs` and `capacities` are
    those it ran with (`GraphCache.search`). Only the first compile's results are kept."""
    record = c.record
    if record.cache is None:
        return run()
    keep = record.plan is None and c.switching is None
    plan, cached = record.cache.search(inputs, capacities, run, keep=keep)
    if keep:
        record.from_cache = tuple(part for part in record.from_cache if part != "plan") + (("plan",) if cached else ())
    return plan


def resumed(c: GraphCompile, plan: Plan) -> Plan:
    """`plan`, or where it came from the cache beside the closed loop's decision of an earlier run, the plan that
    decision put in force, the graph's cost model calibrated as it was and its loop done (runtime/replan.py)."""
    record, loop = c.record, c.loop
    if record.cache is None or loop is None or loop.turns is not None or c.switching is not None:
        return plan
    decided = record.cache.loop()
    if decided is None:
        return plan
    record.costs = calibrated(record.costs, decided["calibration"])
    loop.resume(decided["calibration"], record.costs, switched=decided["plan"] is not None)
    record.from_cache += ("closed loop",)
    log.info(
        "graph %d: the closed loop's decision of an earlier run (%s): %s",
        record.index,
        decided["calibration"],
        "switched to the plan below" if decided["plan"] is not None else "the first plan kept",
    )
    return decided["plan"] or plan


def open_cache(c: GraphCompile, joint: fx.GraphModule, manager) -> GraphCache | None:
    """The graph's entry in the plan cache, as read (empty where there is none); None with plan_cache="off"."""
    if c.config.plan_cache == "off":
        return None
    key = graph_key(c, joint, manager)
    path = default_cache_dir() / PLANS_DIR / f"{_digest(key)[:32]}.json"
    return GraphCache(path=path, key=key, device=c.device, entry=_read(path, key))


def _read(path: Path, key: dict[str, Any]) -> dict[str, Any]:
    """The entry at `path` where it is one of this key and format; else an empty one (with a warning where the
    file is there but cannot be read)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("plan cache %s cannot be read (%s); ignored: the graph is profiled and searched again", path, error)
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        log.warning("plan cache %s is not an entry of format %d; ignored", path, FORMAT)
        return {}
    return data if data.get("key") == key else {}


def graph_key(c: GraphCompile, joint: fx.GraphModule, manager) -> dict[str, Any]:
    """What a graph's entry is found by (module docstring), as JSON values."""
    record = c.record
    key = {
        "graph": graph_digest(joint),
        "blocks": _digest(record.block_map.to_json()),
        "params": _digest({name: entry.to_json() for name, entry in record.param_map.items()}),
        "chunks": _chunks_key(manager),
        "executor": c.config.executor,
        "explain": c.explain,
        "machine": cache_key(c.device),
        "versions": versions(),
    }
    return json.loads(json.dumps(key))  # (tuples as lists: the key as read back)


def _chunks_key(manager) -> dict[str, Any] | None:
    """The model's chunks where built already: their layout, where they are, and whether they wait for a plan."""
    if manager is None:
        return None
    return {
        "layout": _digest(manager.layout.to_json()),
        "pending": manager.pending_plan is not None,
        **plan_fields_of(manager, {}),
    }


def versions() -> dict[str, str | None]:
    """torch's, transformers' and protrain_fx's versions, and a digest of protrain_fx's source (a checkout edited
    between runs keeps its version)."""
    return {
        "torch": torch.__version__,
        "transformers": _installed("transformers"),
        "protrain_fx": _installed("protrain-fx"),
        "source": source_digest(),
    }


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_digest() -> str:
    """A digest of every Python file of the package, by path and content (a few milliseconds)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def graph_digest(gm: fx.GraphModule) -> str:
    """A digest of the graph's structure, the same in every process: each node's op, name, target, arguments, the
    metadata of its value and its recompute tags (never an object's id)."""
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        recompute = node.meta.get("recompute")
        described = (
            node.op,
            node.name,
            _target(node.target),
            _plain(node.args),
            _plain(node.kwargs),
            _value(node.meta.get("val")),
            str(recompute) if recompute is not None else None,
            node.meta.get("ac_graph_id"),
        )
        digest.update(repr(described).encode())
    return digest.hexdigest()


def _target(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__qualname__)}"


def _plain(value: Any) -> Any:
    """A node's argument as plain values: nodes by name, sizes as expressions, objects by type."""
    if isinstance(value, fx.Node):
        return f"%{value.name}"
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple((str(k), _plain(v)) for k, v in value.items())
    if isinstance(value, slice):
        return ("slice", _plain(value.start), _plain(value.stop), _plain(value.step))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.dtype, torch.device, torch.layout)):
        return str(value)
    if isinstance(value, torch.memory_format):
        return str(value)
    if isinstance(value, torch.Tensor):
        return _value(value)
    return type(value).__qualname__


def _value(value: Any) -> Any:
    """A node's value (its `val` metadata) as plain values: a tensor's shape, strides, dtype and device type."""
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(map(str, value.shape)),
            tuple(map(str, value.stride())),
            str(value.dtype),
            value.device.type,
        )
    if isinstance(value, (list, tuple)):
        return tuple(_value(v) for v in value)
    return _plain(value)


def _sizes(at: Sequence[Sizes]) -> list[dict[str, int]]:
    return [{str(s): int(v) for s, v in sizes.items()} for sizes in at]


def _usable(result: dict[str, Any], capacities: tuple[int | None, int | None]) -> bool:
    """Whether a result searched under `result["capacities"]` holds under `capacities`: each near the other, and
    its plan (if any) predicted to fit today's GPU capacity where it fit the one searched under."""
    then = result["capacities"]
    if len(then) != 2 or not all(_near(a, b) for a, b in zip(then, capacities)):
        return False
    if result["plan"] is None:
        if not isinstance(result["no_fit"], str):
            raise TypeError(f"a result with no plan has no message: {result['no_fit']!r}")
        return True
    reserved = plan_from_json(result["plan"]).predicted_reserved_bytes
    gpu, gpu_then = capacities[0], then[0]
    return gpu is None or reserved is None or reserved <= gpu or reserved > gpu_then


def _near(then: int | None, now: int | None) -> bool:
    if then is None or now is None:
        return then is None and now is None
    return abs(int(then) - now) <= CAPACITY_SLACK * max(int(then), now)


def plan_from_json(data: Mapping[str, Any]) -> Plan:
    """A Plan from its `to_json`."""
    fields = {f.name for f in dataclasses.fields(Plan)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"fields {unknown} are no Plan's")
    runners_up = tuple(plan_from_json(r) for r in data.get("runners_up", ()))
    return Plan(**{**data, "block_modes": tuple(data.get("block_modes", ())), "runners_up": runners_up})


def _loop_from_json(stored: Mapping[str, Any]) -> dict[str, Any]:
    plan = stored["plan"]
    return {"calibration": Calibration(**stored["calibration"]), "plan": plan_from_json(plan) if plan else None}


def _digest(value: Any) -> str:
    """sha256 of a JSON value (sorted keys), or of a string as it is."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _agreed(part: Any, device: torch.device) -> bool:
    """Whether every rank has `part` (None: this rank has none), the same."""
    return same_on_every_rank(None if part is None else _digest(part), device)
