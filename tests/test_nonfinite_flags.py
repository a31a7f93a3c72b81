"""The NonfiniteFlags part on its own (protrain_fx/runtime/chunks/nonfinite.py): the step's inf/NaN flag, set by any
gradient checked, kept until cleared, and the copies an update started during the backward reads."""

from __future__ import annotations

import math

import pytest
import torch

from protrain_fx.runtime.chunks.nonfinite import NonfiniteFlags


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_nonfinite_gradient_sets_the_flag_until_the_step_is_over(bad):
    flags = NonfiniteFlags(n_chunk=3, on_device=1, device=torch.device("cpu"))
    flags.check([torch.ones(4), torch.zeros(2, dtype=torch.bfloat16)])
    assert flags.found.item() == 0
    flags.check([torch.tensor([1.0, bad], dtype=torch.bfloat16)])
    flags.check([torch.ones(4)])  # (a finite one later leaves it set)
    assert flags.found.item() == 1
    flags.step_over()
    assert flags.found.item() == 0


def test_an_update_sees_the_flag_as_it_started():
    flags = NonfiniteFlags(n_chunk=3, on_device=1, device=torch.device("cpu"))
    early, host = flags.early(0), flags.to_host(2)
    flags.check([torch.tensor([math.nan])])
    assert early.item() == 0 and host.item() == 0  # (started before the nonfinite gradient)
    assert flags.to_host(1).item() == 1 and flags.early(0).item() == 1


def test_a_norm_past_the_float32_range_counts_as_nonfinite():
    """(The check sums the gradients' norms in fp32: gradients that large mean training has failed anyway.)"""
    flags = NonfiniteFlags(n_chunk=1, on_device=0, device=torch.device("cpu"))
    flags.check([torch.full((4,), 3e38)])
    assert flags.found.item() == 1
