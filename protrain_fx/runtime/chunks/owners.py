"""Owners: which `protrain_fx.optim.AdamW` steps each chunk, as its parameters say (each optimizer marks its own,
`OPTIMIZER_ATTR`, a weak reference).

The layout keeps the parameters of different optimizers in different chunks, so a chunk has one owner or none (no
protrain AdamW steps it: its update never runs). An optimizer built over some of the parameters after the lookup
(`forget`) makes the chunks look theirs up again.

State it owns: the owner of each chunk as last looked up.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

from torch import nn

from protrain_fx.runtime.chunks.common import OPTIMIZER_ATTR


class Owners:
    """The optimizer stepping each chunk (module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], chunk_params: Mapping[int, Sequence[int]], n_chunk: int):
        self._params, self._chunk_params, self._n_chunk = params, chunk_params, n_chunk
        self._owners: dict[int, weakref.ref] = {}  # chunk -> its optimizer, as last looked up

    def of(self, chunk: int):
        """The protrain_fx.optim.AdamW stepping the chunk's parameters (None: no optimizer steps them)."""
        ref = self._owners.get(chunk)
        if ref is not None and ref() is not None:
            return ref()
        owners = {}
        for i in self._chunk_params[chunk]:
            ref = self._params[i].__dict__.get(OPTIMIZER_ATTR)
            if ref is not None and ref() is not None:
                owners[id(ref())] = ref
        if len(owners) > 1:
            raise ValueError(
                f"chunk {chunk} holds parameters of {len(owners)} protrain_fx.optim.AdamW optimizers, and a chunk "
                "is stepped by one: build every optimizer before the model's chunks are built (its first compiled "
                "step, or protrain_fx.prepare), so that the layout keeps each optimizer's parameters apart"
            )
        ref = next(iter(owners.values()), None)
        if ref is not None:
            self._owners[chunk] = ref
        return ref() if ref is not None else None

    def forget(self) -> None:
        """A protrain_fx.optim.AdamW was built over some of the parameters: look the chunks' owners up again."""
        self._owners.clear()

    def check(self) -> None:
        """Raise now where a chunk holds parameters of several optimizers (`of`)."""
        for chunk in range(self._n_chunk):
            self.of(chunk)

    def all(self) -> list:
        """The protrain_fx.optim.AdamW optimizers stepping the chunks, each once, in the order of their first chunk."""
        found = {}
        for chunk in range(self._n_chunk):
            owner = self.of(chunk)
            if owner is not None:
                found[id(owner)] = owner
        return list(found.values())
