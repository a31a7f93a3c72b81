"""The Arrivals part on its own (protrain_fx/runtime/chunks/arrivals.py): when a chunk's gradient of the step is
complete, from the compiled frames that reduce into it and how often the first step ran each."""

from __future__ import annotations

from protrain_fx.runtime.chunks.arrivals import Arrivals


def test_a_frame_gets_one_id_and_a_chunk_is_complete_once_every_frame_reducing_into_it_ran():
    arrivals = Arrivals()
    model, loss = arrivals.source(("model", ("",))), arrivals.source(("loss", ()))
    assert (model, loss) == (0, 1) and arrivals.source(("model", ("",))) == model
    arrivals.expect(0, model)
    arrivals.expect(0, loss)
    arrivals.expect(0, model)  # (a recompile of the frame for another shape: it counts once)
    arrivals.expect(1, model)
    assert not arrivals.complete(0)
    arrivals.arrive(0, model)
    arrivals.arrive(1, model)
    assert not arrivals.complete(0) and arrivals.complete(1)
    arrivals.arrive(0, loss)
    assert arrivals.complete(0)
    arrivals.stepped({0, 1}, first=False)
    assert not arrivals.complete(0) and not arrivals.complete(1)  # (counted afresh each step)
    assert arrivals.complete(2)  # (no frame reduces into it: nothing to wait for)


def test_the_first_step_says_how_often_each_frame_runs_a_step():
    """Accumulation without no_sync: the first step ran the backward twice; later steps wait for both, and a frame
    first seen later is expected as often as the first step's backward ran."""
    arrivals = Arrivals()
    frame = arrivals.source("frame")
    arrivals.expect(0, frame)
    arrivals.arrive(0, frame)
    arrivals.arrive(0, frame)
    arrivals.stepped([0], first=True)
    assert arrivals.backwards_per_step == 2
    arrivals.arrive(0, frame)
    assert not arrivals.complete(0)
    arrivals.arrive(0, frame)
    assert arrivals.complete(0)
    arrivals.stepped([0], first=False)
    later = arrivals.source("a frame compiled later")
    arrivals.expect(1, later)
    arrivals.arrive(1, later)
    assert not arrivals.complete(1)
    arrivals.arrive(1, later)
    assert arrivals.complete(1)


def test_a_step_of_some_chunks_leaves_the_others_counts():
    arrivals = Arrivals()
    frame = arrivals.source("frame")
    for chunk in (0, 1):
        arrivals.expect(chunk, frame)
        arrivals.arrive(chunk, frame)
    arrivals.stepped([0, 5], first=False)
    assert not arrivals.complete(0) and arrivals.complete(1)
