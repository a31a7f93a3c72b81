"""Arrivals: when a chunk's gradient of the step is complete, counted from the compiled backward passes that reduce
into it.

A compiled frame whose backward reduces gradients is a source (`source`, an id for its graphs' `reduce_grads` ops),
registered at compile time with each chunk it reduces into (`expect`). The step's last backward counts each
reduction (`arrive`); a chunk is complete once every source reducing into it has run as often as a step runs it
(`complete`), as the first step showed (`stepped`): more than once where a step accumulates gradients without
`no_sync`, or where one frame's compiles for two calls (a shared embedding) both run. A source first seen after the
first step is expected as many times as that step had backward passes.

State it owns: the sources and the chunks each reduces into, this step's counts, the runs per step.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable


class Arrivals:
    """The reductions of each chunk's gradient in a step, and how many make it complete (module docstring)."""

    def __init__(self) -> None:
        self._sources: dict[Hashable, int] = {}  # a compiled frame (for its modules) -> its id in the graphs' ops
        self._reducing: dict[int, set[int]] = {}  # chunk -> the sources whose backward reduces into it
        self._counts: dict[int, collections.Counter] = {}  # chunk -> source -> its reductions this step
        self._runs_per_step: dict[int, int] = {}  # source -> its backward passes per step, as the first step showed
        self.backwards_per_step = 1  # backward passes in the first step (accumulation without no_sync)

    def source(self, key: Hashable) -> int:
        """The id of a compiled frame (`key`: the frame and the modules its locals are) whose backward reduces
        gradients, for its graphs' `reduce_grads` ops; the same key, the same id."""
        return self._sources.setdefault(key, len(self._sources))

    def expect(self, chunk: int, source: int) -> None:
        """Compile time: the backward of `source` reduces gradients into `chunk` (recompiles of one frame for other
        input shapes count once: only one of them runs)."""
        self._reducing.setdefault(chunk, set()).add(source)

    def arrive(self, chunk: int, source: int) -> None:
        """A reduction into `chunk` by the backward of `source`, in the step's last backward (not inside
        `no_sync`)."""
        self._counts.setdefault(chunk, collections.Counter())[source] += 1

    def complete(self, chunk: int) -> bool:
        """Whether every source reducing into `chunk` has run its backward as often as a step runs it."""
        expected = sum(self._runs_per_step.get(s, self.backwards_per_step) for s in self._reducing.get(chunk, ()))
        return sum(self._counts.get(chunk, {}).values()) >= expected

    def stepped(self, chunks: Iterable[int], *, first: bool) -> None:
        """The chunks' step ended: their reductions are counted afresh. After the first step (`first`), how many
        backward passes it had, per source."""
        counted = set(chunks) & self._counts.keys()
        if first:
            counts = [(s, n) for c in counted for s, n in self._counts[c].items()]
            for s, n in counts:
                self._runs_per_step[s] = max(n, self._runs_per_step.get(s, 0))
            self.backwards_per_step = max(1, min((n for _, n in counts), default=1))
        for chunk in counted:
            del self._counts[chunk]
