"""Host memory: how much there is, and one exact-size pinned arena per owner (chunks, swap slots).

Read by the hardware profile (host capacity) and by the runtime (its host checks), so below both.
"""

from __future__ import annotations

import weakref

import torch


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field (e.g. "MemAvailable", "MemTotal") in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_host_bytes() -> int | None:
    return meminfo_bytes("MemAvailable")


def release_cached_pinned() -> int:
    """Give the pinned blocks torch's caching host allocator keeps unused (`pin_memory()` copies: the hardware
    profile's, a profile on demand's) back to the OS, so that the host memory read next counts them as available.
    Returns the bytes it released (0 where torch's version cannot say, or CUDA has not started: nothing pinned)."""
    if not torch.cuda.is_initialized():
        return 0
    before = _cached_pinned_bytes()
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:  # (torch before the accelerator API had it)
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
    return max(0, before - _cached_pinned_bytes())


def _cached_pinned_bytes() -> int:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return int(stats().get("allocated_bytes.current", 0) if stats is not None else 0)


def check_host_memory(needed: int, what: str, detail: str, advice: str) -> None:
    """Fail before allocating anything when the host cannot hold `needed` bytes of `what` (made of `detail`)."""
    available = available_host_bytes()
    if available is not None and needed > available:
        raise ValueError(
            f"{what} need {needed / 2**30:.2f} GiB of host memory ({detail}) but {available / 2**30:.2f} GiB is "
            f"available; {advice}, or free host memory"
        )


def pinned_arena(nbytes: int, owner: object, *, pin: bool) -> torch.Tensor:
    """One uint8 host tensor of exactly `nbytes`, pinned in place with `cudaHostRegister` when `pin` (not the
    caching host allocator, which rounds up to a power of two) and unregistered when `owner` is collected."""
    arena = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        pin_in_place(arena, owner)
    return arena


def pin_in_place(t: torch.Tensor, owner: object) -> weakref.finalize:
    """Pin a contiguous host tensor where it lies (`cudaHostRegister`), unregistered when `owner` is collected, or
    sooner by calling the finalizer returned (which then lets go of the tensor)."""
    nbytes = t.untyped_storage().nbytes()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    assert int(err) == 0, f"cudaHostRegister of a {nbytes}-byte host tensor failed with error {int(err)}"
    return weakref.finalize(owner, _unregister, t)


def _unregister(arena: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
