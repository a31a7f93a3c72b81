"""The sizes a graph with symbolic sizes is profiled and planned at (shapes.py, profiler/scaling.py).

Its batch symbols are those of an input's first dimension, its sequence symbols the others. It is profiled at its
first call's sizes and at a second, its sequence sizes doubled (halved where they are at their largest already),
and planned for the largest sizes the run will see: the options `max_batch_size` and `max_seq_len` where given;
else the first call's batch size and the model config's `max_position_embeddings` (or NO_LIMIT_GROWTH times the
first call's length where the model names none). Where no plan fits those, the sequence bound halves down to the
first call's, unless the user gave it. The compiled graph is guarded on the bound: a call beyond it compiles and
plans once more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import sympy
import torch

from protrain_fx.config import ProTrainConfig
from protrain_fx.distributed import most_on_every_rank
from protrain_fx.planner.calibrate import device_phases, plan_step_s
from protrain_fx.planner.inputs import cost_model
from protrain_fx.shapes import ShapeRange, symbol_of, values_of

# model config attributes that bound the sequence length, in the order they are read
LENGTH_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
# where the model names no limit (relative positions: T5), the bound is this many times the first call's length,
# so lengths growing past it plan again a few times at most (each time for this many times the longest so far)
NO_LIMIT_GROWTH = 4


@dataclasses.dataclass(frozen=True)
class GraphSizes:
    """A graph's symbols: their values in its first call, and which are batch sizes."""

    first: dict[sympy.Symbol, int]
    batch: frozenset[sympy.Symbol]

    @classmethod
    def of(cls, example_inputs: Sequence[Any], fakes: Sequence[Any], device: torch.device) -> GraphSizes | None:
        """None for a graph of fixed sizes. With several ranks, each size is the largest any rank's first call
        has, so that every rank profiles and plans at the same sizes."""
        first = values_of(example_inputs)
        if not first:
            return None
        first = dict(zip(first, (int(v) for v in most_on_every_rank([float(v) for v in first.values()], device))))
        batch = {
            s for t in fakes if isinstance(t, torch.Tensor) and t.dim() and (s := symbol_of(t.shape[0])) is not None
        }
        return cls(first=first, batch=frozenset(batch))

    def second(self, largest: dict[sympy.Symbol, int]) -> dict[sympy.Symbol, int]:
        """The sizes of the second profile: sequence sizes doubled, or halved where that would pass `largest`
        (the batch sizes as first; where no size can move, every symbol's)."""
        movable = [s for s in self.first if s not in self.batch] or list(self.first)
        out = dict(self.first)
        for s in movable:
            v = self.first[s]
            out[s] = 2 * v if 2 * v <= largest[s] or v < 4 else v // 2
        return out

    def bounds(self, config: ProTrainConfig, model) -> Iterator[tuple[dict[sympy.Symbol, int], bool]]:
        """The largest sizes to plan for, from the widest down, each with whether a smaller one follows."""
        batch = max(config.max_batch_size or 0, *(v for s, v in self.first.items() if s in self.batch), 0)
        first_len = max((v for s, v in self.first.items() if s not in self.batch), default=0)
        limit = config.max_seq_len or _length_limit(model) or NO_LIMIT_GROWTH * first_len
        length = max(limit, first_len)

        def sizes(length: int) -> dict[sympy.Symbol, int]:
            return {s: max(v, batch if s in self.batch else length) for s, v in self.first.items()}

        while config.max_seq_len is None and length > first_len:
            yield sizes(length), True
            length = max(first_len, length // 2)
        yield sizes(length), False

    def shape_range(self, largest: dict[sympy.Symbol, int], profiled: Sequence[dict]) -> ShapeRange:
        return ShapeRange(
            largest={str(s): v for s, v in largest.items()},
            profiled=tuple({str(s): v for s, v in p.items()} for p in profiled),
        )


def _length_limit(model) -> int | None:
    """The longest sequence the model's config allows, where it names one."""
    config = getattr(model, "config", None)
    for name in LENGTH_LIMITS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def guard_within(example_inputs: Sequence[Any], largest: dict[sympy.Symbol, int]) -> None:
    """Guard the graph being compiled on each size input being at most its planned largest: Dynamo compiles the
    frame again for a call beyond (a comparison of a `SymInt` in the compile becomes one of the frame's guards)."""
    for x in example_inputs:
        s = symbol_of(x)
        if s is not None and s in largest:
            assert bool(x <= largest[s]), f"size {s} = {x} beyond the planned {largest[s]}"


def step_predictor(record, example_inputs: Sequence[Any]):
    """For the step monitor of a graph with symbolic sizes (runtime/monitor.py `at_sizes`): the plan's predicted
    step, forward and backward at a step's sizes (its `SymInt` inputs in order, as `step_mark` passes them; none:
    the largest sizes planned), each from the profile fitted there (`ProfileFit.at`); None for fixed sizes."""
    if record.fit is None or record.planning is None or record.shapes is None:
        return None
    symbols = [symbol_of(x) for x in example_inputs if isinstance(x, torch.SymInt)]
    largest = {s: record.shapes.largest[s.name] for s in record.fit.a}
    plan, planning, fit = record.plan, record.planning, record.fit

    def predict(sizes: tuple[int, ...], clipped: bool) -> tuple[float, float, float]:
        assert not sizes or len(sizes) == len(symbols), f"graph {record.index}: sizes {sizes} for symbols {symbols}"
        values = {**largest, **{s: v for s, v in zip(symbols, sizes) if s is not None}}
        costs = cost_model(fit.at(values), planning)
        return (plan_step_s(costs, plan, clipped=clipped), *device_phases(costs, plan))

    return predict
