"""Tests on several ranks: each rank a fresh process in a gloo (or NCCL) process group; an error on a rank goes
to the test, which fails with it."""

import gc
import multiprocessing
import os
import tempfile

import torch
import torch.distributed as dist

# ranks start from a fork server that imported these once per test process, not each rank again (seconds of a
# small machine's CPU per rank); on a GPU machine these imports initialise CUDA, so CUDA ranks start afresh
# (`_context`). The torch._inductor and torch.export modules are what a process's first torch.compile imports
# (AOTAutograd's decompositions and pattern matcher, even under the eager executor): about a second of each rank's
# first compile. The transformers modules and torch's distributed tensor are what building a LLaMA and tracing it
# import (lazily): another second
PRELOAD = [
    "torch",
    "transformers",
    "pytest",
    "protrain_fx",
    "models",
    "helpers",
    "torch._inductor.compile_fx",
    "torch._inductor.lowering",
    "torch._inductor.pattern_matcher",
    "torch._inductor.decomposition",
    "torch._functorch.partitioners",
    "torch.export._trace",
    "torch.distributed.tensor.experimental",
    "transformers.modeling_utils",
    "transformers.masking_utils",
    "transformers.models.llama.modeling_llama",
]


# the collector's thresholds in the test processes (conftest.py `_fewer_collections`) and in those they start
FEWER_COLLECTIONS = (50_000, 20, 100)


def collect_less() -> None:
    """In a process the tests started (a rank, `in_a_process`, a relaunch): the collector's FEWER_COLLECTIONS,
    for the rest of that process."""
    gc.set_threshold(*FEWER_COLLECTIONS)


def join(backend: str, rank: int, world: int, rendezvous: str) -> None:
    """Join the process group through a file of the spawning test's own: tests running side by side (pytest -n)
    never meet, as they could on a port found free and then taken."""
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def _context(cuda: bool = False):
    """CUDA ranks start afresh ("spawn"): on a GPU machine the fork server's preloaded modules initialise CUDA, and
    a rank forked from it fails ("Cannot re-initialize CUDA in forked subprocess")."""
    if cuda:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def spawn(target, world: int, *args, cuda: bool = False) -> None:
    """Run `target(rank, world, rendezvous, *args, errors)` in `world` processes (`cuda`: ranks that use the GPUs);
    fail with their errors."""
    ctx = _context(cuda)
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="protrain-ranks-") as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        procs = [ctx.Process(target=target, args=(r, world, rendezvous, *args, errors)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not messages, messages
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def in_a_process(target, *args, timeout: float = 600) -> int | None:
    """Run `target(*args)` in a fresh process, started as the ranks are; its exit code (None if still running)."""
    process = _context().Process(target=_with_fewer_collections, args=(target, *args))
    process.start()
    process.join(timeout)
    return process.exitcode


def _with_fewer_collections(target, *args) -> None:
    collect_less()
    target(*args)


def run_rank(backend: str, rank: int, world: int, rendezvous: str, errors, body) -> None:
    """Run `body()` as one rank of a `backend` process group (NCCL: on GPU `rank`); an error (with its notes) goes to
    the parent, which fails the test, and leaves the group up: tearing it down waits for the other ranks'
    collectives, which on NCCL hangs."""
    collect_less()
    if backend == "nccl":
        torch.cuda.set_device(rank)
    join(backend, rank, world, rendezvous)
    try:
        body()
    except BaseException as e:
        errors.put(" ".join([f"rank {rank}: {type(e).__name__}: {e}", *getattr(e, "__notes__", ())]))
        raise
    dist.destroy_process_group()


def gloo_rank(rank: int, world: int, rendezvous: str, errors, body) -> None:
    """Run `body()` as one gloo rank (`run_rank`)."""
    run_rank("gloo", rank, world, rendezvous, errors, body)


def _gloo_worker(rank: int, world: int, rendezvous: str, body, errors) -> None:
    gloo_rank(rank, world, rendezvous, errors, lambda: body(rank, world))


def spawn_gloo(body, world: int) -> None:
    """Run `body(rank, world)` (a module-level function) on `world` gloo ranks, each a spawned process."""
    spawn(_gloo_worker, world, body)
