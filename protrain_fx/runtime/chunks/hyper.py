"""HyperparametersSeen: the hyperparameters (lr, betas, eps, weight_decay) a step's updates started with, and those
each optimizer had as its gradients of the step arrived: what its `step()` compares the hyperparameters of then
against, since a change between backward() and step() applies to the step, as in torch's AdamW.

An optimizer is named by its `id` (the part holds no reference to it).

State it owns: chunk -> the hyperparameters its update of this step started with; optimizer -> its hyperparameters
as its last gradient of the step arrived.
"""

from __future__ import annotations

from collections.abc import Iterable


class HyperparametersSeen:
    """The hyperparameters of the step's started updates and of its backward (module docstring)."""

    def __init__(self) -> None:
        self._used: dict[int, list[dict]] = {}  # chunk -> those its update of this step started with
        self._at_backward: dict[int, list[dict]] = {}  # id(optimizer) -> those as its last gradient arrived

    def started(self, chunk: int, hyper: list[dict]) -> None:
        """The chunk's update of this step started with `hyper`."""
        self._used[chunk] = hyper

    def used(self, chunk: int) -> list[dict]:
        """The hyperparameters the chunk's update of this step started with."""
        return self._used[chunk]

    def arrived(self, owner: int, hyper: list[dict]) -> None:
        """A gradient of the chunks of optimizer `owner` (its id) arrived while it had `hyper`."""
        self._at_backward[owner] = hyper

    def changed(self, owner: int, now: list[dict], chunks: Iterable[int]) -> tuple[bool, list[int]]:
        """At `owner`'s step, its hyperparameters `now`: whether they differ from those of its backward, and the
        chunks among `chunks` (its own) whose update started with others."""
        mine = set(chunks)
        stale = [c for c, used in self._used.items() if c in mine and used != now]
        seen = self._at_backward.get(owner)
        return (seen is not None and seen != now) or bool(stale), stale

    def stepped(self, owner: int) -> None:
        """Optimizer `owner` stepped: its backward's hyperparameters are forgotten."""
        self._at_backward.pop(owner, None)

    def ended(self, chunks: Iterable[int]) -> None:
        """The chunks' step ended: what their updates started with is forgotten."""
        for chunk in set(chunks) & self._used.keys():
            del self._used[chunk]

    def closed(self) -> None:
        """The step is over for every optimizer."""
        self._at_backward.clear()
