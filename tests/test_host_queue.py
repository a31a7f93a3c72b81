"""The host worker runs, among the tasks whose copy has landed, the lowest chunk first, keeps nothing once a task
ran, and beside a GPU runs on this rank's share of the cores, where OpenMP threads spinning beside it are warned
of."""

import gc
import os
import threading
import weakref

import models
import pytest
import torch
from helpers import train

import protrain_fx
from protrain_fx.host_queue import HostQueue, host_threads


def test_beside_a_gpu_the_worker_runs_on_this_ranks_share_of_the_cores(monkeypatch):
    """Two ranks of a 32-core machine under torchrun, which sets torch's thread count to 1 in each: the worker
    runs torch's CPU kernels on 16 cores less the one left to the thread launching GPU work."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_threads() == 16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (torchrun's OMP_NUM_THREADS=1)
    try:
        seen = []
        queue = HostQueue(spare_core=True)
        queue.submit(0, None, lambda: seen.append(torch.get_num_threads())).result(timeout=10)
        queue.close()
        assert seen == [15]
    finally:
        torch.set_num_threads(threads)


def test_lowest_landed_chunk_first_and_errors_reach_the_waiter():
    queue = HostQueue()
    started, gate, ran = threading.Event(), threading.Event(), []
    first = queue.submit(9, None, lambda: (started.set(), gate.wait(), ran.append(9)))
    started.wait(timeout=10)  # the worker is busy with 9 while the others queue up
    later = [queue.submit(c, None, lambda c=c: ran.append(c)) for c in (7, 3, 5)]
    gate.set()
    for f in [first, *later]:
        f.result(timeout=10)
    assert ran == [9, 3, 5, 7]

    def fail():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        queue.submit(1, None, fail).result(timeout=10)
    queue.close()


def test_a_finished_task_is_not_kept():
    """The worker keeps no reference to a task once it ran (a task's closure holds a chunk manager, and through
    it GPU chunks that would outlive their model)."""

    class Held:
        pass

    queue, held = HostQueue(), Held()
    ref = weakref.ref(held)
    queue.submit(0, None, lambda held=held: None).result(timeout=10)
    del held
    gc.collect()
    assert ref() is None
    queue.close()


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "protrain-cpu-adam"}


def test_a_dropped_model_frees_its_chunks_and_worker_thread():
    """(Through inductor, which keeps its last compile's config, the partitioner in it; one block: four chunks,
    three offloaded, whose updates run on the worker.)"""
    before = _workers()  # (other tests' models may be alive in this process)
    model = models.build("toy", layers=1)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"plan": {"n_persist": 1, "n_buffer": 3}})  # (inductor)
    compiled = torch.compile(model, backend=backend)
    # (the second step runs the offloaded chunks' updates on the worker)
    train(compiled, "toy", 2, opt=opt, batch=lambda step: models.batch("toy", 2, 16, seed=step))
    protrain_fx.manager_of(model).wait_for_update()  # (the last step's host updates may still be running)
    manager = weakref.ref(protrain_fx.manager_of(model))
    assert _workers() - before
    del model, opt, compiled, backend
    torch._dynamo.reset()
    gc.collect()
    assert manager() is None
    assert not _workers() - before


@pytest.mark.gpu
def test_spinning_openmp_threads_are_warned_of(monkeypatch, caplog):
    """OpenMP threads that spin when idle slow the offloaded chunks' host AdamW about threefold: a plan that
    offloads chunks says so."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    model = models.big_llama(hidden=1024, layers=8)
    protrain_fx.optim.AdamW(model.parameters(), lr=1e-4)  # (chunks are made for this optimizer)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"plan": {"n_persist": 2, "n_buffer": 2}}))
    ids = torch.randint(0, 32000, (2, 64), device="cuda")
    with caplog.at_level("WARNING", logger="protrain_fx.runtime.chunks"):
        compiled(input_ids=ids, labels=ids).loss.backward()
    assert any("OMP_WAIT_POLICY=ACTIVE" in r.getMessage() for r in caplog.records)
