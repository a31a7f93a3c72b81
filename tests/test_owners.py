"""The Owners part on its own (protrain_fx/runtime/chunks/owners.py): the protrain AdamW stepping each chunk, as its
parameters' marks say, looked up once, again after `forget`; a chunk of two optimizers is an error that says what
to do."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from protrain_fx.runtime.chunks.common import OPTIMIZER_ATTR
from protrain_fx.runtime.chunks.owners import Owners


class Optimizer:
    """A stand-in: what marks a parameter as stepped by it."""

    def mark(self, *params: nn.Parameter) -> None:
        for p in params:
            p.__dict__[OPTIMIZER_ATTR] = weakref.ref(self)


def _params(n: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(2)) for _ in range(n)]


def test_each_chunk_has_the_optimizer_of_its_parameters_or_none():
    params = _params(4)
    owners = Owners(params, {0: [0, 1], 1: [2], 2: [3]}, 3)
    first, second = Optimizer(), Optimizer()
    first.mark(params[0], params[1])
    second.mark(params[2])
    assert owners.of(0) is first and owners.of(1) is second and owners.of(2) is None
    assert owners.all() == [first, second]


def test_an_owner_is_looked_up_once_and_again_after_forget():
    params = _params(1)
    owners = Owners(params, {0: [0]}, 1)
    old, new = Optimizer(), Optimizer()
    old.mark(params[0])
    assert owners.of(0) is old
    new.mark(params[0])
    assert owners.of(0) is old  # (as last looked up)
    owners.forget()
    assert owners.of(0) is new


def test_an_owner_gone_is_looked_up_again():
    params = _params(1)
    owners = Owners(params, {0: [0]}, 1)
    gone = Optimizer()
    gone.mark(params[0])
    assert owners.of(0) is gone
    del gone
    assert owners.of(0) is None and owners.all() == []


def test_a_chunk_of_two_optimizers_is_an_error_that_says_to_build_them_first():
    params = _params(2)
    owners = Owners(params, {0: [0, 1]}, 1)
    a, b = Optimizer(), Optimizer()
    a.mark(params[0])
    b.mark(params[1])
    with pytest.raises(ValueError, match="chunk 0 holds parameters of 2 protrain_fx.optim.AdamW optimizers.*build"):
        owners.check()
