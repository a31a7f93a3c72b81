"""ProTrainConfig: every option of the backend, validated once, and the package's own environment variables
($PROTRAIN_DUMP_DIR, $PROTRAIN_PLAN_CACHE; $PROTRAIN_CACHE_DIR in cache_dir.py). Variables set by others are read
where they are used: LOCAL_WORLD_SIZE (host_queue.py, profiler/hardware.py) and OMP_WAIT_POLICY
(runtime/chunks/updates.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from protrain_fx.planner.plan import check_forced_fields

EXECUTORS = ("inductor", "eager")
MIN_MEMORY_BYTES = 2**16  # a memory option below this is a mistake (GiB given as bytes, say), not a budget
ON_OOM = ("raise", "replan")
REPLAN = ("on", "off")
PLAN_CACHE = ("on", "off")
DUMP_DIR_ENV = "PROTRAIN_DUMP_DIR"
PLAN_CACHE_ENV = "PROTRAIN_PLAN_CACHE"  # the `plan_cache` option's default ("on" or "off") where options name none


@dataclasses.dataclass(frozen=True)
class ProTrainConfig:
    """Options of `torch.compile(model, backend="protrain", options={...})`. None is required.

    executor: "inductor" compiles the rewritten graphs with inductor (fast); "eager" runs the FX graphs
        directly (for debugging and for exact parity checks).
    plan: plan fields to force instead of searching them, as a dict or the path of a plan JSON file.
    gpu_memory_bytes: the GPU capacity the planner may assume (default: the device's free memory).
    host_memory_bytes: the host memory the planner may assume for this rank's offloaded chunks and swap space
        (default on CUDA: the host's available memory, less a reserve for the rest of training, shared among this
        machine's ranks: profiler/hardware.py host_capacity; on the CPU, where the "device" is the host, not
        budgeted). Where it has no room for a gradient shard per offloaded chunk, the chunks share fewer (the
        plan's host_grad_slots).
    dump_dir: where graphs, profiles, maps and plans are written (default: $PROTRAIN_DUMP_DIR, else nothing).
    on_oom: what a CUDA out-of-memory error in a step does (runtime/oom.py): "raise" an error that names the plan
        and what to do, or "replan" under a lower capacity and go on.
    replan: "on" re-plans each training graph once from what its first measured steps show (runtime/replan.py:
        the cost model calibrated to training's host AdamW rate and memory fragmentation, the search run again,
        and a plan predicted faster by more than the switch's margin put in force between two steps); "off"
        keeps the first plan. A plan with every field forced is never re-planned. A list of plan-field dicts
        compares plans in one run: after the first plan's measured steps, each is put in force in turn for its
        own (the plan the first compile would have searched with its fields forced over `plan`'s; `{}`: the plan
        the closed loop keeps in force), and the dump's replan.json lists each plan's measurements (`python -m
        bench predict --in-turn`).
    max_seq_len, max_batch_size: the largest sequence length and batch size the run will see, for a graph
        compiled with dynamic shapes (`dynamic=True`, or Dynamo's default after a second shape): its plan is made
        for them and holds for every smaller shape. Default: the model config's `max_position_embeddings` (as
        far as a plan fits memory) and the batch size of the graph's first call; a larger shape compiles and
        plans the graph once more.
    plan_cache: "on" (default; $PROTRAIN_PLAN_CACHE where the options name none) keeps each graph's profile, plan
        and the closed loop's choice in the cache directory ($PROTRAIN_CACHE_DIR/plans, backend/cache.py), keyed by
        what they depend on, so that a relaunch with nothing changed profiles and searches nothing and starts with
        the plan the last run ended with; "off" profiles and searches every graph and keeps nothing.
    """

    executor: str = "inductor"
    plan: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    gpu_memory_bytes: int | None = None
    host_memory_bytes: int | None = None
    dump_dir: str | None = None
    on_oom: str = "raise"
    replan: str | tuple[Mapping[str, Any], ...] = "on"
    max_seq_len: int | None = None
    max_batch_size: int | None = None
    plan_cache: str = "on"

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | ProTrainConfig | None) -> ProTrainConfig:
        """Build a config from `torch.compile`'s `options=` dict; unknown keys and wrong types raise ValueError."""
        if isinstance(options, ProTrainConfig):
            return options
        options = dict(options or {})
        accepted = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(f"unknown protrain option(s) {unknown}; accepted options are {accepted}")
        if "dump_dir" not in options and os.environ.get(DUMP_DIR_ENV):
            options["dump_dir"] = os.environ[DUMP_DIR_ENV]
        if "plan_cache" not in options and os.environ.get(PLAN_CACHE_ENV):
            options["plan_cache"] = os.environ[PLAN_CACHE_ENV]
        if "plan" in options:
            options["plan"] = _load_plan_option(options["plan"])
        if isinstance(options.get("replan"), list):
            options["replan"] = tuple(options["replan"])
        config = cls(**options)
        config._validate()
        return config

    def _validate(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"option 'executor' must be one of {list(EXECUTORS)}, got {self.executor!r}")
        if self.on_oom not in ON_OOM:
            raise ValueError(f"option 'on_oom' must be one of {list(ON_OOM)}, got {self.on_oom!r}")
        if self.plan_cache not in PLAN_CACHE:
            raise ValueError(
                f"option 'plan_cache' (or ${PLAN_CACHE_ENV}) must be one of {list(PLAN_CACHE)}, got {self.plan_cache!r}"
            )
        if isinstance(self.replan, tuple):
            _check_turns(self.replan)
        elif self.replan not in REPLAN:
            raise ValueError(
                f"option 'replan' must be one of {list(REPLAN)} or a list of plan-field dicts, got {self.replan!r}"
            )
        for name in ("gpu_memory_bytes", "host_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"option {name!r} must be an int number of bytes, got {type(value).__name__}")
            if value is not None and value <= 0:
                raise ValueError(f"option {name!r} must be positive, got {value}")
            if value is not None and value < MIN_MEMORY_BYTES:
                raise ValueError(
                    f"option {name!r} is {value} bytes, too little to hold any model: it takes a number of bytes, "
                    "e.g. 80 * 2**30 for 80 GiB"
                )
        for name in ("max_seq_len", "max_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"option {name!r} must be a positive int, got {value!r}")
        check_forced_fields(self.plan)
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ValueError(f"option 'dump_dir' must be a path, got {type(self.dump_dir).__name__}")


# the fields a plan in turn may not set: the chunks are built once, by the first plan
FIXED_IN_TURN = ("n_chunk", "chunk_bytes", "master_dtype")


def _check_turns(turns: tuple) -> None:
    """The `replan` option as a list of plans put in force in turn: each a dict of plan fields, none of
    FIXED_IN_TURN."""
    if not turns:
        raise ValueError("option 'replan' is an empty list; give plan-field dicts to run in turn, or 'on' / 'off'")
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise ValueError(f"option 'replan'[{i}] must be a dict of plan fields, got {type(turn).__name__}")
        try:
            check_forced_fields(turn)
        except ValueError as error:
            raise ValueError(f"option 'replan'[{i}]: {error}") from None
        fixed = sorted(set(turn) & set(FIXED_IN_TURN))
        if fixed:
            raise ValueError(
                f"option 'replan'[{i}] sets {fixed}, which the chunks fix when they are built; set them in 'plan'"
            )


def _load_plan_option(plan: Any) -> dict[str, Any]:
    """The `plan` option: a dict of forced fields, or the path of a plan JSON file written by a dump."""
    if isinstance(plan, (str, os.PathLike)):
        path = Path(plan)
        if not path.is_file():
            raise ValueError(f"option 'plan' names {str(path)!r}, which is not a file; pass a dict or a plan.json path")
        return json.loads(path.read_text())
    if not isinstance(plan, Mapping):
        raise ValueError(f"option 'plan' must be a dict of plan fields or a plan.json path, got {type(plan).__name__}")
    return dict(plan)
