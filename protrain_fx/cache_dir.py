"""Where what protrain measures or plans is kept across runs: $PROTRAIN_CACHE_DIR, read by the hardware profile
(profiler/hardware.py), the plan cache (backend/cache.py) and the closed loop's advice (runtime/monitor.py).

A module of its own, importing nothing of the package, so that every stage reads the one directory."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PROTRAIN_CACHE_DIR"


def default_cache_dir() -> Path:
    """Where measurements kept across runs go: $PROTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/protrain_fx, else
    ~/.cache/protrain_fx."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "protrain_fx"
