"""Chunk layout: which parameter lives where in which chunk (paper §4.1, "Chunk Organization and Size Search").

Parameters are laid out in execution order (first use; a shared parameter at its first use) into chunks of one size. The
parameters of one transformer block go into one chunk where the size allows: a block that does not fit in what is left
of the current chunk starts a new one. A parameter the forward reads again after other blocks ran (`alone`: a tied
embedding, which the head reads at the end) gets a chunk of its own: the graph gathers its chunk once per stretch of
reads and releases it between (passes/chunks.py), so it holds a buffer only while read, and gathering it again loads
that parameter alone, not the first block with it. Parameters of different groups (the optimizers stepping them) never
share a chunk. The chunk size is chosen by a grid search that simulates the layout at each candidate size and keeps the
one wasting the fewest bytes; sizes wasting at most WASTE_TIE of the parameters' bytes more count as tied, and the
largest of them wins: fewer chunks mean fewer transfers and fewer persistent counts for the search to time (a model
whose blocks split evenly into smaller chunks can waste a hair less in three times as many). Every chunk is padded to
a multiple of `world_size * ALIGN` elements, so each rank's shard of a chunk has the same size for any world size.

Search range: from the largest parameter (a parameter is never split) to twice the largest block (so that
chunks stay near block size and `n_persist` keeps a fine grain), on a geometric grid.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

ALIGN = 64  # elements; shards start on 128-byte (bf16) / 256-byte (fp32) boundaries
GRID_POINTS = 48
WASTE_TIE = 0.005  # share of the parameters' bytes within which two sizes' waste counts as equal


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A parameter to lay out, in execution order."""

    name: str
    numel: int
    block: int | None  # transformer block, None outside blocks
    alone: bool = False  # in a chunk of its own (read again after other blocks: a tied embedding)
    group: int = 0  # the optimizer stepping it: a chunk holds one group's parameters


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one parameter lives: chunk index and element offset in it."""

    name: str
    chunk: int
    offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    chunk_elems: int  # elements per chunk, padding included (a multiple of world_size * ALIGN)
    element_size: int  # bytes per element of the parameters' dtype
    world_size: int
    slots: tuple[Slot, ...]  # in execution order
    n_chunk: int

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_elems * self.element_size

    @property
    def shard_elems(self) -> int:
        return self.chunk_elems // self.world_size

    @property
    def waste_bytes(self) -> int:
        return (self.n_chunk * self.chunk_elems - sum(s.numel for s in self.slots)) * self.element_size

    def chunk_slots(self, chunk: int) -> list[Slot]:
        return [s for s in self.slots if s.chunk == chunk]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChunkLayout:
        return cls(**{**data, "slots": tuple(Slot(**s) for s in data["slots"])})


def _units(params: Sequence[ParamInfo]) -> list[list[ParamInfo]]:
    """Runs of consecutive parameters of one block; each parameter outside blocks is a run of its own."""
    units: list[list[ParamInfo]] = []
    for p in params:
        same = units and units[-1][-1].block == p.block and units[-1][-1].group == p.group
        if same and p.block is not None and not p.alone:
            units[-1].append(p)
        else:
            units.append([p])
    return units


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def layout_at(params: Sequence[ParamInfo], chunk_elems: int, element_size: int, world_size: int) -> ChunkLayout:
    """The layout at one chunk size (elements, already a multiple of world_size * ALIGN)."""
    assert chunk_elems % (world_size * ALIGN) == 0, f"chunk of {chunk_elems} elements is not shard-aligned"
    slots: list[Slot] = []
    chunk, used, group = 0, 0, params[0].group if params else 0
    for unit in _units(params):
        size = sum(p.numel for p in unit)
        if used and (unit[0].group != group or (size <= chunk_elems and used + size > chunk_elems)):
            chunk, used = chunk + 1, 0  # another optimizer's, or a block kept whole: a fresh chunk
        group, alone = unit[0].group, unit[0].alone
        if alone and used:
            chunk, used = chunk + 1, 0
        for p in unit:
            assert p.numel <= chunk_elems, f"parameter {p.name} ({p.numel} elements) exceeds the chunk size"
            if used + p.numel > chunk_elems:
                chunk, used = chunk + 1, 0
            slots.append(Slot(name=p.name, chunk=chunk, offset=used, numel=p.numel))
            used += p.numel
        if alone:
            used = chunk_elems  # (the next parameter starts a chunk)
    n_chunk = chunk + 1 if slots else 0
    return ChunkLayout(chunk_elems, element_size, world_size, tuple(slots), n_chunk)


def search_layout(
    params: Sequence[ParamInfo], element_size: int, world_size: int = 1, *, chunk_bytes: int | None = None
) -> ChunkLayout:
    """The least wasteful layout, of the largest chunks among near ties (module docstring); `chunk_bytes` forces the
    size instead."""
    if not params:
        raise ValueError("the model has no trainable parameters to lay out in chunks")
    align = world_size * ALIGN
    if chunk_bytes:
        elems = _round_up(max(chunk_bytes // element_size, 1), align)
        largest = max(p.numel for p in params)
        if elems < largest:
            raise ValueError(
                f"plan chunk_bytes={chunk_bytes} is smaller than the largest parameter "
                f"({largest * element_size} bytes); choose at least that"
            )
        return layout_at(params, elems, element_size, world_size)
    lo = max(p.numel for p in params)
    hi = max(lo, 2 * max(sum(p.numel for p in u) for u in _units(params)))
    ratio = (hi / lo) ** (1 / (GRID_POINTS - 1)) if hi > lo else 1.0
    candidates = sorted({_round_up(math.ceil(lo * ratio**i), align) for i in range(GRID_POINTS)})
    layouts = [layout_at(params, c, element_size, world_size) for c in candidates]
    tied = min(layout.waste_bytes for layout in layouts) + WASTE_TIE * sum(p.numel for p in params) * element_size
    return max((layout for layout in layouts if layout.waste_bytes <= tied), key=lambda layout: layout.chunk_elems)
