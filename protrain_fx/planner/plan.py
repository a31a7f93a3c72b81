"""The plan: every memory decision for one compiled graph, made once and frozen.

Later stages only read it. It is JSON-serializable so it can be dumped and replayed
(`options={"plan": "plan.json"}`). This version of the backend applies no memory optimization: the only
plan it carries out keeps everything resident (all chunks persistent, no block checkpointed or swapped).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

BLOCK_MODES = ("none", "checkpoint", "swap")


@dataclasses.dataclass(frozen=True)
class Plan:
    n_persist: int = 0  # chunks kept on the GPU (the first n_persist in execution order)
    n_buffer: int = 0  # pre-allocated GPU buffers for non-persistent chunks
    n_swap: int = 0  # blocks whose activations are swapped to CPU memory
    n_checkpoint: int = 0  # blocks recomputed in backward
    n_chunk: int = 0  # chunks of the parameter layout (0: parameters are left where they are)
    n_block: int = 0  # transformer blocks found in the graph
    chunk_bytes: int = 0
    block_modes: tuple[str, ...] = ()
    predicted_step_s: float | None = None
    predicted_peak_bytes: int | None = None
    runners_up: tuple[Plan, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["block_modes"] = list(self.block_modes)
        data["runners_up"] = [p.to_json() for p in self.runners_up]
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def __str__(self) -> str:
        rows = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "runners_up"]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))


def resident_plan(n_block: int, forced: Mapping[str, Any] | None = None) -> Plan:
    """The everything-resident plan for a graph of `n_block` blocks, after checking the user's forced fields.

    Forced fields are accepted when they agree with a resident plan; anything that asks for offloading,
    checkpointing or swapping is refused with a clear error, since this version does not carry it out.
    """
    forced = dict(forced or {})
    unknown = sorted(set(forced) - set(PLAN_FIELDS))
    if unknown:
        raise ValueError(f"unknown plan field(s) {unknown} in options['plan']; plan fields are {list(PLAN_FIELDS)}")
    modes = tuple(forced.get("block_modes", ("none",) * n_block))
    bad = [m for m in modes if m not in BLOCK_MODES]
    if bad:
        raise ValueError(f"options['plan']['block_modes'] has unknown mode(s) {bad}; modes are {list(BLOCK_MODES)}")
    if len(modes) != n_block:
        raise ValueError(f"options['plan']['block_modes'] has {len(modes)} entries but the graph has {n_block} blocks")
    for key in ("n_swap", "n_checkpoint", "n_buffer", "n_chunk", "chunk_bytes"):
        value = forced.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"options['plan'][{key!r}] must be a non-negative int, got {value!r}")
    asked = {k: v for k, v in forced.items() if k in ("n_swap", "n_checkpoint", "n_buffer", "n_chunk") and v}
    asked.update({"block_modes": modes} if any(m != "none" for m in modes) else {})
    if asked:
        raise ValueError(
            f"options['plan'] asks for {asked}, but this version of protrain only keeps everything resident "
            "(no chunk offload, checkpointing or swapping yet); drop those fields"
        )
    return Plan(n_block=n_block, block_modes=modes)
