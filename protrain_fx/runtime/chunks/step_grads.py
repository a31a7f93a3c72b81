"""`StepGrads`: which chunks and parameters hold a gradient of this step, and the persistent chunks' reductions not
landed yet. The reduce path (reduce.py) adds gradients and the gradient access (user_grads.py) reads, edits and
drops them; both change this shared record through its methods, neither writes the other's fields.

- `chunks`: chunks whose gradient holds this step's values (the step's first gradient overwrites, later ones add);
- `params`: parameters (manager indices) that got a gradient this step;
- `unreduced`: persistent chunks whose gradient is this rank's sum only (backward passes inside `no_sync`),
  all-reduced once before it is read;
- `in_flight`: persistent chunks' all-reduces started without blocking, landed in their gradient later:
  (chunk, reduce buffer, work, whether it adds to the gradient);
- `norms`: offloaded chunk -> (norm type, the norm of this rank's gradient shard as it arrived, None where it
  arrived in parts): clipping reads these instead of waiting for the copies to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist


class StepGrads:
    def __init__(self) -> None:
        self.chunks: set[int] = set()
        self.params: set[int] = set()
        self.unreduced: set[int] = set()
        self.in_flight: list[tuple[int, torch.Tensor, dist.Work, bool]] = []
        self.norms: dict[int, tuple[float, torch.Tensor | None]] = {}

    def arrive(self, chunk: int) -> bool:
        """A gradient of `chunk` arrives; whether it adds to one of this step (else it overwrites: `zero_grad`
        never memsets)."""
        adds = chunk in self.chunks
        self.chunks.add(chunk)
        return adds

    def got(self, indices: Iterable[int]) -> None:
        """The parameters of `indices` hold a gradient of this step."""
        self.params.update(indices)

    def with_grad(self, indices: Iterable[int]) -> list[int]:
        """Those of `indices` that hold a gradient of this step."""
        return [i for i in indices if i in self.params]

    def drop(self, indices: Iterable[int]) -> None:
        """The parameters of `indices` hold no gradient of this step any more."""
        self.params.difference_update(indices)

    def forget(self, chunk: int) -> None:
        """`chunk` holds no gradient of this step any more: its arrival norm and what it had left to reduce go; an
        all-reduce of it in flight is waited for (its buffer is reused) and not landed."""
        self.chunks.discard(chunk)
        self.norms.pop(chunk, None)
        self.unreduced.discard(chunk)
        for entry in [e for e in self.in_flight if e[0] == chunk]:
            entry[2].wait()
            self.in_flight.remove(entry)

    def reduce_later(self, chunk: int) -> None:
        """`chunk`'s gradient is this rank's sum only (inside `no_sync`), reduced once before it is read."""
        self.unreduced.add(chunk)

    def reduce_now(self, chunk: int) -> bool:
        """Whether `chunk` held this rank's sum, to be reduced with the gradient arriving now (it no longer does)."""
        held = chunk in self.unreduced
        self.unreduced.discard(chunk)
        return held

    def start(self, chunk: int, flat: torch.Tensor, work: dist.Work, adds: bool) -> None:
        """An all-reduce of `chunk`'s gradient in the reduce buffer `flat` runs (`work`), landed later (`land`)."""
        self.in_flight.append((chunk, flat, work, adds))

    def land(self, each: Callable[[int, torch.Tensor, dist.Work, bool], None]) -> None:
        """`each(chunk, flat, work, adds)` for every all-reduce in flight, in order; then none is in flight (where
        `each` raises, all stay, to be waited for again)."""
        for entry in self.in_flight:
            each(*entry)
        self.in_flight.clear()

    def reduce_sums(self, each: Callable[[int], None]) -> None:
        """`each(chunk)` for every chunk holding this rank's sum, in order; then none does (where `each` raises,
        all stay)."""
        for chunk in sorted(self.unreduced):
            each(chunk)
        self.unreduced.clear()

    def drop_sums(self) -> None:
        """The sums left to reduce are dropped with the step's gradients."""
        self.unreduced.clear()

    def note_norm(self, chunk: int, norm_type: float, norm: torch.Tensor | None) -> None:
        """The `norm_type` norm of `chunk`'s gradient shard as it arrived (None: it arrived in parts)."""
        self.norms[chunk] = (norm_type, norm)

    def forget_norms(self, chunks: Iterable[int]) -> None:
        """The arrival norms of `chunks` go (their update ran)."""
        for chunk in chunks:
            self.norms.pop(chunk, None)

    def arrival_norms(self, norm_type: float) -> dict[int, torch.Tensor]:
        """Offloaded chunk -> the `norm_type` norm of this rank's shard of its gradient (a 0-dim tensor on the
        device), for the chunks whose gradient of this step arrived whole."""
        return {
            chunk: norm
            for chunk, (kind, norm) in self.norms.items()
            if kind == norm_type and norm is not None and chunk in self.chunks
        }

    def idle(self) -> bool:
        """No gradient of this step held, none in flight or left to reduce."""
        return not (self.chunks or self.in_flight or self.unreduced)
