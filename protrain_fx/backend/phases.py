"""One line per long phase of a graph's compile, and the plan chosen, for a log that is not a terminal:

    protrain: graph 0: captured in 2.31 s
    protrain: graph 0: profiled in 8.02 s                 (or: profile from the plan cache, <entry>)
    protrain: graph 0: searched in 0.47 s                 (or: plan from the plan cache, <entry>)
    protrain: graph 0: plan n_persist=6 n_buffer=0 of 6 chunks, ... (searched)
    protrain: graph 0: forward compiled in 11.60 s
    protrain: graph 0: backward compiled in 14.02 s

They are records of the logger `protrain_fx.progress` at INFO, on rank 0, so a program's own logging configuration
shows them or not as it does any library's INFO records. Where the program configured no logging at all (no handler
on the root logger or on a protrain_fx logger, and no level set on them) and stderr is not a terminal (a batch job's
log), the package gives that logger a handler of its own that writes them to stderr, as tqdm draws its bars there
without being asked; on a terminal the progress bars show instead (progress.py). The handler goes again as soon as
the program configures logging. To silence the lines: `logging.getLogger("protrain_fx.progress").setLevel(
logging.WARNING)`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from protrain_fx.distributed import rank_and_world_size
from protrain_fx.runtime.oom import plan_summary

PROGRESS_LOGGER = "protrain_fx.progress"
log = logging.getLogger(PROGRESS_LOGGER)

DONE = {"capture": "captured", "profile": "profiled", "search": "searched", "forward": "forward compiled"}
DONE["backward"] = "backward compiled"
FROM_CACHE = {"profile": "profile", "search": "plan"}  # what a phase found in the plan cache instead


class StderrFallback(logging.StreamHandler):
    """The handler the package gives its progress logger where the program configured no logging: to whatever
    sys.stderr is when a line is written."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("protrain: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        super().emit(record)


def phase_done(index: int, phase: str, seconds: float | None, cache: Any = None) -> None:
    """Graph `index`'s `phase` (a key of DONE) took `seconds`; None: its result came from the plan cache entry
    `cache` (backend/cache.py)."""
    _route()
    if seconds is not None:
        log.info("graph %d: %s in %.2f s", index, DONE[phase], seconds)
    elif cache is not None and phase in FROM_CACHE:
        log.info("graph %d: %s from the plan cache (%s)", index, FROM_CACHE[phase], cache.describe())


def plan_chosen(index: int, plan: Any, from_cache: tuple[str, ...]) -> None:
    """The plan graph `index` starts with, once."""
    _route()
    source = f"from the plan cache: {', '.join(from_cache)}" if "plan" in from_cache else "searched"
    log.info("graph %d: plan %s (%s)", index, plan_summary(plan), source)


def _route() -> None:
    """The fallback handler on the progress logger where wanted (module docstring), and gone where not."""
    ours = [h for h in log.handlers if isinstance(h, StderrFallback)]
    wanted = _unconfigured(bool(ours)) and not _is_terminal() and rank_and_world_size()[0] == 0
    if wanted and not ours:
        log.addHandler(StderrFallback())
        log.setLevel(logging.INFO)
        log.propagate = False  # (nothing above handles it: the fallback alone writes it)
    elif ours and not wanted:
        for handler in ours:
            log.removeHandler(handler)
        log.setLevel(logging.NOTSET)
        log.propagate = True


def _unconfigured(fallback_on: bool) -> bool:
    """Whether the program configured no logging that reaches the progress logger: no handler on the root logger,
    on `protrain_fx` (TORCH_LOGS sets one) or on the progress logger but the fallback, and no level set on
    `protrain_fx` or on the progress logger (but the fallback's)."""
    package = logging.getLogger("protrain_fx")
    if logging.getLogger().handlers or package.handlers or package.level != logging.NOTSET:
        return False
    if any(not isinstance(h, StderrFallback) for h in log.handlers):
        return False
    return fallback_on or log.level == logging.NOTSET


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # (replaced by an object without it, or closed)
        return False
