"""Symbolic sizes: a graph compiled with dynamic shapes (`torch.compile(dynamic=True)`, or Dynamo's automatic
dynamic after a second shape) takes its batch and sequence sizes as `SymInt` inputs, each a sympy symbol.

The profiler runs such a graph at concrete sizes: `values_of` reads each symbol's value from the inputs of one call
(a `SymInt` input holds its hint, the size of the call that compiled the graph), `at_sizes` makes real inputs of
other sizes (each tensor tiled or cut along its symbolic dimensions), and `evaluate` turns any size, symbolic or
not, into an int at given values. `ShapeRange` is what a plan covers: each symbol's largest value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

Sizes = Mapping[sympy.Symbol, int]  # a value for each symbol of a graph


def hint(size: Any) -> int:
    """A size as an int: a symbolic one's hint, read without adding a guard (0 where it has none)."""
    if isinstance(size, torch.SymInt):
        return int(size.node.hint or 0)
    return int(size)


def symbol_of(size: Any) -> sympy.Symbol | None:
    """The symbol a `SymInt` input is (None for an int, or a size that is an expression of several)."""
    if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
        return size.node.expr
    return None


def values_of(inputs: Sequence[Any]) -> dict[sympy.Symbol, int]:
    """Each symbol of a graph's `SymInt` inputs and its value in this call (its hint where it is symbolic)."""
    return {s: hint(x) for x in inputs if (s := symbol_of(x)) is not None}


def expr_of(size: Any) -> sympy.Expr:
    """`size` (an int, a `SymInt` or a sympy expression) as a sympy expression of the graph's symbols."""
    return sympy.sympify(size.node.expr if isinstance(size, torch.SymInt) else size)


def evaluate(size: Any, values: Sizes) -> int:
    """`size` (an int, a `SymInt` or a sympy expression) as an int at `values`."""
    return SizesAt(values)(size)


class SizesAt:
    """Sizes as ints at fixed `values`, each distinct expression worked out once: a graph's thousands of nodes
    share a few dozen size expressions, and sympy's substitution is what costs."""

    def __init__(self, values: Sizes):
        self.values = dict(values)
        self._replace = {s: sympy.Integer(v) for s, v in self.values.items()}
        self._memo: dict[sympy.Expr, int] = {}

    def __call__(self, size: Any) -> int:
        if isinstance(size, int):
            return size
        expr = expr_of(size)
        found = self._memo.get(expr)
        if found is None:
            value = expr.xreplace(self._replace)
            assert value.is_number, f"size {expr} has symbols without a value in {self.values}"
            found = self._memo[expr] = int(value)
        return found


def size_at(size: Any, values: Sizes | SizesAt | None) -> int:
    """`size` as an int at `values`, or at its hint where `values` is None (read without adding a guard)."""
    if values is None:
        return hint(size)
    return values(size) if isinstance(values, SizesAt) else evaluate(size, values)


def at_sizes(inputs: Sequence[Any], fakes: Sequence[Any], values: Sizes) -> list[Any]:
    """The graph's real `inputs` made for the sizes `values`: a `SymInt` input becomes its value, a tensor whose
    compile-time value in `fakes` has symbolic dimensions is tiled (or cut) along them to the sizes they take at
    `values`, so token ids stay token ids; every other input is passed as it is."""
    out = []
    for x, fake in zip(inputs, fakes):
        if isinstance(x, torch.SymInt):
            out.append(evaluate(x, values))
        elif isinstance(x, torch.Tensor) and isinstance(fake, torch.Tensor) and _symbolic_dims(fake):
            out.append(_resized(x, [evaluate(d, values) for d in fake.shape]))
        else:
            out.append(x)
    return out


def dense_order(t: torch.Tensor) -> list[int]:
    """`t`'s dimensions from innermost to outermost by their strides (at their hints, read without a guard), a
    dimension of size 1 before others of its stride: the layout `torch.empty_like` gives `t`, as an order that
    holds at any sizes (`strides_in`)."""
    sizes, strides = [hint(d) for d in t.shape], [hint(s) for s in t.stride()]
    return sorted(range(t.dim()), key=lambda d: (strides[d], sizes[d] != 1, -d))


def strides_in(shape: Sequence[Any], order: Sequence[int]) -> list[Any]:
    """The strides of a dense tensor of `shape` (ints or `SymInt`s) whose dimensions go innermost to outermost in
    `order` (`dense_order`)."""
    stride: list[Any] = [0] * len(shape)
    step: Any = 1
    for d in order:
        stride[d] = step
        step = step * shape[d]
    return stride


def _symbolic_dims(fake: torch.Tensor) -> bool:
    return any(isinstance(d, torch.SymInt) and not d.node.is_constant() for d in fake.shape)


def _resized(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """`t` tiled along each dimension that must grow, then cut to `shape` (a new, contiguous tensor; `t` itself
    where its shape is `shape`)."""
    if list(t.shape) == shape:
        return t
    for dim, size in enumerate(shape):
        if size > t.shape[dim]:
            t = t.repeat(*[-(-size // t.shape[dim]) if d == dim else 1 for d in range(t.dim())])
        t = t.narrow(dim, 0, size)
    return t.contiguous()


@dataclasses.dataclass(frozen=True)
class ShapeRange:
    """The sizes a plan covers: each symbol's largest value (by name, as JSON keeps it), and the sizes the graph's
    profile was measured at. A call whose sizes all lie within `largest` runs on the plan (backend/sizes.py guards
    the graph on them)."""

    largest: dict[str, int]
    profiled: tuple[dict[str, int], ...] = ()

    def at_largest(self, size: Any) -> int:
        """`size` (an int, a `SymInt` or a sympy expression of the graph's symbols) at the largest sizes covered."""
        expr = expr_of(size)
        return evaluate(expr, {s: self.largest[s.name] for s in expr.free_symbols})

    def describe(self) -> str:
        return ", ".join(f"{name} <= {size}" for name, size in sorted(self.largest.items())) or "fixed shapes"
