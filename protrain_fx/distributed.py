"""What every stage needs of torch.distributed: this rank and the world size, collectives that name themselves
when a peer is gone, the check that every rank builds the same chunks, the least or most of a value on any
rank, and for the caches on disk: which rank writes a machine's files, and whether every rank read the same.

Below the profiler, the planner and the runtime, which all read it; it imports none of them (`check_ranks_agree`
reads the chunk layout it is given as a `LayoutLike`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from protrain_fx.real_tensors import real_tensors


def rank_and_world_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def writes_machine_files() -> bool:
    """Whether this rank writes its machine's cache files: each machine's local rank 0 (torchrun's LOCAL_RANK; a
    process started otherwise is its machine's only rank), so that every machine of a multi-node run keeps its own
    (a cache directory on a shared file system gets the same file from each)."""
    rank, _ = rank_and_world_size()
    return int(os.environ.get("LOCAL_RANK", rank)) == 0


def same_on_every_rank(text: str | None, device: torch.device) -> bool:
    """Whether every rank has `text` (None: this rank has none) and all are equal: what each machine read from its
    own cache, used only where every rank would decide from the same. On one rank, whether it has it."""
    _, world = rank_and_world_size()
    if world == 1:
        return text is not None
    mine = 0 if text is None else int(hashlib.sha256(text.encode()).hexdigest()[:15], 16) + 1
    least, minus_most = least_on_every_rank([mine, -mine], device, "the check that every rank read the same cache")
    return least != 0 and least == -minus_most


class CollectiveError(RuntimeError):
    """A collective of the chunks failed on a multi-rank run: another rank has most likely died or left."""


@contextlib.contextmanager
def across_ranks(what: str) -> Iterator[None]:
    """Name the collective and the likely cause when one fails with several ranks (gloo: the peer's connection
    closed; NCCL: the communicator aborted after its timeout), instead of the backend's bare message."""
    try:
        yield
    except RuntimeError as e:
        rank, world = rank_and_world_size()
        if world == 1 or isinstance(e, CollectiveError):
            raise
        raise CollectiveError(
            f"rank {rank} of {world}: {what} failed ({type(e).__name__}: {e}). Another rank has most likely died "
            "or stopped (see its log), and this one cannot go on without it: restart every rank, resuming from "
            "the last checkpoint (protrain_fx.state_dict with torch.distributed.checkpoint)"
        ) from e


class SlotLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def numel(self) -> int: ...


class LayoutLike(Protocol):
    """What `check_ranks_agree` reads of a chunk layout (planner/chunking.py `ChunkLayout`)."""

    @property
    def chunk_elems(self) -> int: ...

    @property
    def n_chunk(self) -> int: ...

    @property
    def slots(self) -> Sequence[SlotLike]: ...


def check_ranks_agree(layout: LayoutLike, n_persist: int, n_buffer: int, n_device_shard: int = 0) -> None:
    """Every rank must lay out the same parameters the same way and plan alike; raise on all ranks if not
    (a disagreement would otherwise hang in the first collective of unequal size). Chunks whole on every rank
    (a layout for one) reduce their gradients across all ranks too."""
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return
    mine = (
        layout.chunk_elems,
        layout.n_chunk,
        (n_persist, n_device_shard),
        n_buffer,
        [(s.name, s.numel) for s in layout.slots],
    )
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        first = everyone[differ[0]]
        names = dict(first[4])
        diff = [(n, k) for n, k in everyone[0][4] if names.get(n) != k][:3]
        raise ValueError(
            f"ranks {differ} disagree with rank 0 on the model or plan: rank 0 has {everyone[0][1]} chunks of "
            f"{everyone[0][0]} elements ((n_persist, n_device_shard)={everyone[0][2]}, n_buffer={everyone[0][3]}), "
            f"rank {differ[0]} {first[1]} chunks of {first[0]} ((n_persist, n_device_shard)={first[2]}, "
            f"n_buffer={first[3]}); first parameters that "
            f"differ: {diff or 'their order'}. Build the same model and pass the same options on every rank"
        )


def least_on_every_rank(
    values: list[int | None],
    device: torch.device,
    what: str = "the all-reduce of the GPU and host capacities the plan is searched under",
) -> list[int | None]:
    """Each of `values` (capacities in bytes; None: not budgeted) as the least any rank has, so that every rank
    plans under the same limits."""
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return values
    unset = torch.iinfo(torch.int64).max
    with real_tensors():
        where = device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor([unset if v is None else v for v in values], dtype=torch.int64, device=where)
        with across_ranks(what):
            dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        least = mine.tolist()  # (a device-to-host copy: out of a fake mode, as planning inside the partitioner is)
    return [None if v == unset else v for v in least]


def most_on_every_rank(values: list[float], device: torch.device) -> list[float]:
    """Each of `values` as the largest any rank has (float64), so that every rank decides from the same numbers."""
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return values
    with real_tensors():
        where = device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor(values, dtype=torch.float64, device=where)
        with across_ranks("the all-reduce of the scales training measured"):
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return mine.tolist()
