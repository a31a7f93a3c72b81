"""The plan: every memory decision for one compiled graph, made once and frozen.

Later stages only read it. It is JSON-serializable so it can be dumped and replayed
(`options={"plan": "plan.json"}`). This version carries out the chunk fields (`n_persist`, `n_buffer`,
forced by the user; all chunks persistent by default) and no activation checkpointing or swapping.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from protrain_fx.planner.chunking import ChunkLayout

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
CHUNK_FIELDS = ("n_persist", "n_buffer", "n_chunk", "chunk_bytes")


def _int_field(forced: Mapping[str, Any], key: str, default: int) -> int:
    value = forced.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"options['plan'][{key!r}] must be a non-negative int, got {value!r}")
    return value


def make_plan(n_block: int, forced: Mapping[str, Any] | None = None, layout: ChunkLayout | None = None) -> Plan:
    """The plan for a graph of `n_block` blocks, after checking the user's forced fields.

    Without a chunk layout (parameters not managed in chunks) everything stays where it is. With one, the
    forced `n_persist` and `n_buffer` are taken, and by default every chunk is persistent. Activation
    checkpointing and swapping are not carried out yet: asking for them is refused with a clear error.
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
    asked = {k: forced[k] for k in ("n_swap", "n_checkpoint") if _int_field(forced, k, 0)}
    asked.update({"block_modes": modes} if any(m != "none" for m in modes) else {})
    if asked:
        raise ValueError(
            f"options['plan'] asks for {asked}, but this version of protrain does not checkpoint or swap "
            "activations yet; drop those fields"
        )
    if layout is None:
        chunked = {k: forced[k] for k in ("n_buffer", "n_chunk", "chunk_bytes") if _int_field(forced, k, 0)}
        if "n_persist" in forced and forced.get("n_chunk", 1) != 0:  # (a replayed unchunked plan has n_chunk 0)
            chunked["n_persist"] = _int_field(forced, "n_persist", 0)
        if chunked:
            raise ValueError(
                f"options['plan'] asks for {chunked}, but parameters are managed in chunks only when the model "
                "is trained with protrain_fx.optim.AdamW; create that optimizer before the first step"
            )
        return Plan(n_block=n_block, block_modes=modes)
    n_persist = _int_field(forced, "n_persist", layout.n_chunk)
    if n_persist > layout.n_chunk:
        raise ValueError(f"options['plan']['n_persist']={n_persist} exceeds the model's {layout.n_chunk} chunks")
    n_buffer = _int_field(forced, "n_buffer", 0 if n_persist == layout.n_chunk else min(2, layout.n_chunk - n_persist))
    if n_persist < layout.n_chunk and n_buffer < 1:
        raise ValueError("options['plan']['n_buffer'] must be at least 1 when some chunks are not persistent")
    return Plan(
        n_persist=n_persist,
        n_buffer=n_buffer,
        n_chunk=layout.n_chunk,
        n_block=n_block,
        chunk_bytes=layout.chunk_bytes,
        block_modes=modes,
    )
