"""Progress bars for the long phases (parameters into chunks, profiling, the hardware measurement): `tqdm` on
rank 0, shown only where stderr is a terminal (a batch job's log gets the `logging` lines instead)."""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch.distributed as dist
from tqdm import tqdm


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str, unit: str = "it") -> tqdm:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    shown = rank == 0 and sys.stderr.isatty()
    return tqdm(
        iterable, total=total, desc=f"protrain: {desc}", unit=unit, disable=not shown, leave=False, file=sys.stderr
    )
