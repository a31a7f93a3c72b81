"""Progress bars for the long phases (parameters into chunks, profiling, the hardware measurement): `tqdm` on
rank 0, shown only where stderr is a terminal (a batch job's log gets the `logging` lines instead)."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm

from protrain_fx.distributed import rank_and_world_size


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str, unit: str = "it") -> tqdm:
    shown = rank_and_world_size()[0] == 0 and sys.stderr.isatty()
    return tqdm(
        iterable, total=total, desc=f"protrain: {desc}", unit=unit, disable=not shown, leave=False, file=sys.stderr
    )
