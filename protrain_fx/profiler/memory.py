"""Memory trackers for the profiler: the caching allocator's statistics on CUDA, a dispatch mode on CPU.

Both answer the same three questions: bytes allocated now, the peak since the last reset, and reset the
peak. On CUDA the allocator also sees temporaries inside an op (workspaces, intermediate buffers). On CPU
only tensors that reach Python dispatch are seen: an op's outputs, not buffers its kernel allocates and
frees internally, so a CPU intra-op delta is the size of what the op returns.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class CudaMemoryTracker:
    """Reads `torch.cuda` allocator statistics of one device."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> CudaMemoryTracker:
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        return None

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """The allocator already counts every CUDA tensor."""

    def forget(self, storage) -> None:
        """The allocator sees a storage resized to 0 bytes by itself."""

    # `torch.cuda.memory_allocated` and `max_memory_allocated` flatten every allocator statistic into one dict in
    # Python, slower than a small kernel; the profile reads them around each of thousands of nodes, so read the one
    # it needs
    def _allocated_bytes(self, which: str) -> int:
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)  # {} before CUDA is initialized
        return stats["allocated_bytes"]["all"][which] if stats else 0

    def allocated(self) -> int:
        return self._allocated_bytes("current")

    def peak(self) -> int:
        return self._allocated_bytes("peak")

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class CpuMemoryTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages created under it (plus those handed to `track`).

    Each new storage is counted once, whatever views of it exist, and uncounted when its last reference
    dies (a finalizer on the storage object, which PyTorch keeps alive exactly as long as the storage).
    """

    supports_higher_order_operators = True  # e.g. run_and_save_rng_state in recomputing graphs: outputs counted

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self._allocated = 0
        self._peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages if they are not counted yet."""
        for tensor in tensors:
            if tensor.device.type == "meta" or tensor.is_sparse:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            nbytes = storage.nbytes()
            if key in self._live or nbytes == 0:
                continue
            self._live[key] = nbytes
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)
            weakref.finalize(storage, call_if_alive, weakref.WeakMethod(self._release), key)  # (see call_if_alive)

    def forget(self, storage) -> None:
        """Stop counting a storage (about to be resized to 0 bytes); `track` counts it again once refilled."""
        self._release(storage._cdata)

    def _release(self, key: int) -> None:
        self._allocated -= self._live.pop(key, 0)

    def allocated(self) -> int:
        return self._allocated

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._allocated


def tensor_bytes(values) -> int:
    """Bytes of the distinct storages behind the tensors in `values` (a pytree)."""
    seen: dict[int, int] = {}
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen.setdefault(storage.data_ptr() or id(storage), storage.nbytes())
    return sum(seen.values())


def call_if_alive(method: weakref.WeakMethod, *args) -> None:
    """A storage finalizer's callback that holds its object weakly: `weakref.finalize` keeps its callback in a
    global registry until the storage dies, and a storage the profiled model keeps would keep a bound method's
    object, and what that object holds, alive with the model."""
    bound = method()
    if bound is not None:
        bound(*args)
