"""The StepGrads part on its own (protrain_fx/runtime/chunks/step_grads.py): which chunks and parameters hold a
gradient of the step, the all-reduces in flight and the sums left to reduce, the arrival norms. Work objects are
stand-ins that count their waits; nothing runs across ranks."""

from __future__ import annotations

import pytest
import torch

from protrain_fx.runtime.chunks.step_grads import StepGrads


class Work:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1


def test_the_first_gradient_of_a_chunk_overwrites_and_later_ones_add():
    grads = StepGrads()
    assert grads.idle()
    assert grads.arrive(3) is False and grads.arrive(3) is True and grads.arrive(1) is False
    grads.got([7, 8])
    assert grads.chunks == {1, 3} and grads.with_grad([6, 7, 8, 9]) == [7, 8] and not grads.idle()
    grads.drop([7])
    assert grads.with_grad([7, 8]) == [8]


def test_forgetting_a_chunk_waits_for_its_all_reduce_and_drops_its_norm_and_sum():
    grads = StepGrads()
    mine, other = Work(), Work()
    for chunk, work in ((0, mine), (1, other)):
        grads.arrive(chunk)
        grads.start(chunk, torch.zeros(2), work, False)
    grads.reduce_later(0)
    grads.note_norm(0, 2.0, torch.tensor(1.0))
    grads.forget(0)
    assert mine.waits == 1 and other.waits == 0
    assert [entry[0] for entry in grads.in_flight] == [1] and not grads.unreduced and not grads.norms
    assert grads.chunks == {1}


def test_landing_and_reducing_visit_each_once_in_order_and_keep_them_where_one_fails():
    grads = StepGrads()
    for chunk in (2, 0):
        grads.start(chunk, torch.zeros(1), Work(), chunk == 0)
        grads.reduce_later(chunk)
    landed: list[tuple[int, bool]] = []
    grads.land(lambda chunk, flat, work, adds: landed.append((chunk, adds)))
    assert landed == [(2, False), (0, True)] and not grads.in_flight

    def fail(chunk):
        raise RuntimeError(f"chunk {chunk}")

    with pytest.raises(RuntimeError, match="chunk 0"):
        grads.reduce_sums(fail)
    assert grads.unreduced == {0, 2}  # (kept, to be reduced again)
    reduced: list[int] = []
    grads.reduce_sums(reduced.append)
    assert reduced == [0, 2] and not grads.unreduced
    assert grads.reduce_now(5) is False
    grads.reduce_later(5)
    assert grads.reduce_now(5) is True and not grads.unreduced


def test_arrival_norms_are_those_of_the_norm_asked_of_whole_arrivals_still_held():
    grads = StepGrads()
    for chunk in (0, 1, 2, 3):
        grads.arrive(chunk)
    grads.note_norm(0, 2.0, torch.tensor(1.0))
    grads.note_norm(1, 2.0, None)  # (arrived in parts)
    grads.note_norm(2, 1.0, torch.tensor(3.0))  # (another norm type)
    grads.note_norm(3, 2.0, torch.tensor(4.0))
    grads.forget(3)
    assert list(grads.arrival_norms(2.0)) == [0]
    grads.forget_norms([0])
    assert grads.arrival_norms(2.0) == {} and grads.chunks == {0, 1, 2}
