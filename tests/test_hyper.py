"""The HyperparametersSeen part on its own (protrain_fx/runtime/chunks/hyper.py): what a step's updates started with
and each optimizer's hyperparameters at its backward, against those at its step."""

from __future__ import annotations

from protrain_fx.runtime.chunks.hyper import HyperparametersSeen

OLD, NEW = [{"lr": 0.01}], [{"lr": 0.001}]


def test_a_change_since_the_backward_is_seen_and_so_are_updates_started_with_the_old_values():
    seen = HyperparametersSeen()
    seen.arrived(1, OLD)
    assert seen.changed(1, OLD, [0, 1]) == (False, [])
    assert seen.changed(1, NEW, [0, 1]) == (True, [])
    seen.started(1, OLD)
    seen.started(5, OLD)  # (another optimizer's chunk)
    assert seen.used(1) == OLD
    assert seen.changed(1, NEW, [0, 1]) == (True, [1])
    assert seen.changed(2, NEW, [5]) == (True, [5])  # (an optimizer whose backward was not seen: its updates)


def test_a_step_forgets_its_optimizer_and_its_chunks_and_the_close_forgets_every_backward():
    seen = HyperparametersSeen()
    seen.arrived(1, OLD)
    seen.arrived(2, OLD)
    seen.started(0, OLD)
    seen.stepped(1)
    seen.ended([0])
    assert seen.changed(1, NEW, [0]) == (False, []) and seen.changed(2, NEW, []) == (True, [])
    seen.closed()
    assert seen.changed(2, NEW, []) == (False, [])
