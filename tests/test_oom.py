"""Out of GPU memory in a step (runtime/oom.py). The CPU has no allocator to run out, so the error is raised where
a CUDA allocation would fail: a chunk gather in a forward, a gradient reduction in a backward, building the
chunks. Under on_oom="raise" (the default) the error names the plan and what to do. Under "replan" training
goes on: a failed forward runs again under the new plan (losses bitwise those of an uninterrupted run), a
failed backward loses its step (bitwise a run without that batch). Toy model, fp32, eager executor unless
named."""

import logging

import models
import pytest
import torch
from helpers import OFFLOADED

import protrain_fx
from protrain_fx.runtime.chunks import ChunkManager
from protrain_fx.runtime.oom import SHRINK

BIG = 2**40  # a capacity nothing on the CPU comes near
FAIL_AT = 2  # after the first step, so offloaded updates start during the backward (the first step defers them)


class Inject:
    """Make `ChunkManager.<name>` raise a CUDA-style out-of-memory error once, when armed, after `after` calls."""

    def __init__(self, monkeypatch, name: str, *, armed: bool = False, after: int = 0):
        self.armed, self.after, self.fired = armed, after, 0
        original = getattr(ChunkManager, name)

        def method(manager, *args, **kwargs):
            if self.armed and self.after:
                self.after -= 1
            elif self.armed:
                self.armed = False
                self.fired += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected by the test)")
            return original(manager, *args, **kwargs)

        monkeypatch.setattr(ChunkManager, name, method)


def _run(options, steps=FAIL_AT + 2, *, inject=None, skip=(), executor="eager", shape=(2, 16), layers=3):
    """Train the toy model (`layers` blocks) on batches 0..steps-1 (less `skip`), arming `inject` before step
    FAIL_AT's forward. Returns (losses, skipped steps, backend, model)."""
    model = models.build("toy", layers=layers)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"executor": executor, **options})
    compiled = torch.compile(model, backend=backend)
    losses, skipped = [], []
    for step in (s for s in range(steps) if s not in skip):
        if inject is not None and step == FAIL_AT:
            inject.armed = True
        loss = compiled(**models.batch("toy", *shape, seed=step))
        loss.backward()
        opt.step()
        skipped.append(opt.last_step_skipped)
        opt.zero_grad()
        losses.append(loss.item())
    return losses, skipped, backend, model


def _replan(**more):
    return {"plan": OFFLOADED, "gpu_memory_bytes": BIG, "on_oom": "replan", **more}


def test_forward_out_of_memory_is_replanned_and_run_again(monkeypatch, caplog):
    expected, *_ = _run(_replan())
    inject = Inject(monkeypatch, "gather")
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        losses, skipped, backend, _ = _run(_replan(), inject=inject)
    assert inject.fired == 1
    assert losses == expected and not any(skipped)  # nothing lost: the forward ran again
    assert backend.graphs[0].capacity == int(BIG * SHRINK)
    assert "re-planned" in caplog.text and "re-plan 1 of at most" in caplog.text


def test_backward_out_of_memory_loses_the_step(monkeypatch, caplog):
    expected, _, _, reference = _run(_replan(), skip=(FAIL_AT,))
    inject = Inject(monkeypatch, "reduce_grads")
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        losses, skipped, backend, model = _run(_replan(), inject=inject)
    assert inject.fired == 1
    assert skipped == [step == FAIL_AT for step in range(FAIL_AT + 2)]
    assert losses[:FAIL_AT] + losses[FAIL_AT + 1 :] == expected  # as if the batch had not been there
    after, want = protrain_fx.full_state_dict(model), protrain_fx.full_state_dict(reference)
    assert all(torch.equal(after[k], want[k]) for k in want)
    assert backend.graphs[0].capacity == int(BIG * SHRINK)  # re-planned before the next forward
    assert "this step is lost" in caplog.text and "optimizer step skipped" in caplog.text


def test_backward_out_of_memory_after_an_update_started_is_an_error(monkeypatch):
    # the first reduction completes the last chunk, whose host update starts at once: the step is half done
    inject = Inject(monkeypatch, "reduce_grads", after=1)
    with pytest.raises(torch.OutOfMemoryError, match=r"partly updated already \(chunks \[\d"):
        _run(_replan(), inject=inject)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_error_names_the_plan_and_what_to_do(monkeypatch, where):
    inject = Inject(monkeypatch, "gather" if where == "forward" else "reduce_grads")
    with pytest.raises(torch.OutOfMemoryError) as raised:
        _run({"plan": OFFLOADED, "gpu_memory_bytes": BIG}, inject=inject)
    message = str(raised.value)
    assert f"the {where} of graph 0 ran out of GPU memory" in message
    assert "n_persist=1 n_buffer=3 of" in message and "predicted peak" in message
    assert f"planned for a capacity of {BIG / 2**30:.2f} GiB" in message
    assert "options={'on_oom': 'replan'}" in message and f"'gpu_memory_bytes': {int(BIG * SHRINK)}" in message
    assert "injected by the test" in message  # torch's own line


def test_no_plan_under_the_lower_capacity_is_an_error(monkeypatch):
    _, _, backend, _ = _run({"plan": OFFLOADED}, steps=1)
    capacity = backend.graphs[0].plan.predicted_reserved_bytes or backend.graphs[0].plan.predicted_peak_bytes
    with pytest.raises(torch.OutOfMemoryError, match=r"re-planned under \d+ bytes, where no plan fits the GPU"):
        _run(_replan(gpu_memory_bytes=capacity), inject=Inject(monkeypatch, "gather"))


def test_replans_are_bounded(monkeypatch):
    def always(manager, chunk):  # every forward fails
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    monkeypatch.setattr(ChunkManager, "gather", always)
    with pytest.raises(torch.OutOfMemoryError, match=r"re-planned 4 times down to"):
        _run(_replan())


def test_chunk_building_out_of_memory_is_searched_again(monkeypatch):
    Inject(monkeypatch, "rebuild", armed=True)
    losses, _, backend, _ = _run({"gpu_memory_bytes": BIG, "on_oom": "replan"})
    assert backend.graphs[0].capacity == int(BIG * SHRINK)
    expected, *_ = _run({"gpu_memory_bytes": BIG})
    assert losses == expected
    Inject(monkeypatch, "rebuild", armed=True)
    # (raised while compiling: Dynamo wraps it, its message kept)
    with pytest.raises(Exception, match="OutOfMemoryError: protrain: the chunk building of graph 0 ran out"):
        _run({"gpu_memory_bytes": BIG})


def test_replan_under_a_lower_capacity_saves_activations(monkeypatch):
    """Planned with no capacity, every activation is kept; re-planned under 90% of that plan's predicted peak,
    blocks are checkpointed, selective or swapped (a batch whose activations outweigh the toy model's states)."""
    chunks, shape = {"n_persist": 1, "n_buffer": 6}, (16, 64)
    _, _, backend, _ = _run({"plan": chunks}, steps=1, shape=shape)
    first = backend.graphs[0].plan
    assert first.n_checkpoint == first.n_swap == 0
    capacity = first.predicted_reserved_bytes or first.predicted_peak_bytes
    inject = Inject(monkeypatch, "gather")
    _, _, backend, _ = _run(_replan(plan=chunks, gpu_memory_bytes=capacity), inject=inject, shape=shape)
    plan = backend.graphs[0].plan
    assert plan.n_checkpoint + plan.n_selective + plan.n_swap > 0
    assert (plan.predicted_reserved_bytes or plan.predicted_peak_bytes) <= int(capacity * SHRINK)


def test_inductor_backward_out_of_memory_loses_the_step(monkeypatch):
    """Inductor's compiled backward under the guard (activation fields forced: the test is the guard's). The
    reference runs the eager executor: inductor's CPU kernels agree with it to the tolerance, and the test
    compiles with inductor only where the guard is, twice (before and after the re-plan), so on a one-block
    toy model (inductor's compile time grows with the kernels of the graph, not with the steps)."""
    options = _replan(plan={**OFFLOADED, "n_swap": 0, "n_checkpoint": 0})
    expected, *_ = _run(options, skip=(FAIL_AT,), layers=1)
    inject = Inject(monkeypatch, "reduce_grads")
    losses, skipped, _, _ = _run(options, inject=inject, executor="inductor", layers=1)
    assert skipped == [step == FAIL_AT for step in range(FAIL_AT + 2)]
    assert losses[:FAIL_AT] + losses[FAIL_AT + 1 :] == pytest.approx(expected, rel=1e-5)


def test_on_oom_option_is_checked():
    with pytest.raises(ValueError, match=r"option 'on_oom' must be one of \['raise', 'replan'\], got 'retry'"):
        protrain_fx.ProTrainBackend({"on_oom": "retry"})
