import gc
import os
import sys
from pathlib import Path

import pytest
import torch

from protrain_fx.host_queue import host_threads

sys.path.insert(0, str(Path(__file__).parent))
from spawn import collect_less  # noqa: E402


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True, scope="session")
def _threads_per_worker():
    """Under pytest-xdist, each worker's torch gets its share of the cores (as torchrun gives each rank), and so do
    the processes it starts (gloo ranks, bench workers: OMP_NUM_THREADS): with torch's default, one thread per
    core in every worker, the workers' threads outnumber the cores and each parallel op waits on a thread that the
    scheduler has given to another worker (tests of thread counts set their own). Inductor's compile workers too:
    with one core a worker, inductor compiles in the process rather than starting (and importing torch in) a pool
    of compile processes in every worker and rank. Restored after the session."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        yield
        return
    from torch._inductor import config as inductor_config

    threads = torch.get_num_threads()
    share = max(1, host_threads() // workers)  # (the cores this process may run on)
    torch.set_num_threads(share)
    compile_threads = {} if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ else {"compile_threads": share}
    with pytest.MonkeyPatch.context() as patch, inductor_config.patch(compile_threads):
        if "OMP_NUM_THREADS" not in os.environ:
            patch.setenv("OMP_NUM_THREADS", str(share))
        if compile_threads:  # (the started processes read it when they import inductor)
            patch.setenv("TORCHINDUCTOR_COMPILE_THREADS", str(share))
        yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _no_plan_cache():
    """Each test profiles and searches its own graphs: the plan cache (protrain_fx/backend/cache.py) is off for the
    session, spawned ranks included, unless $PROTRAIN_PLAN_CACHE says otherwise or a test turns it on
    (tests/test_plan_cache.py)."""
    with pytest.MonkeyPatch.context() as patch:
        if "PROTRAIN_PLAN_CACHE" not in os.environ:
            patch.setenv("PROTRAIN_PLAN_CACHE", "off")
        yield


@pytest.fixture(autouse=True, scope="session")
def _hardware_cache(tmp_path_factory):
    """Hardware profiles measured by the tests go to a directory of this session, not the user's cache (spawned
    ranks inherit it). Under pytest-xdist the workers of one run share it (their base directories lie in the
    run's), so each world size is measured once per run, not once per worker (a profile is written whole under a
    temporary name, then renamed: a worker reads one whole or none)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    cache = base / "protrain_cache"
    cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:  # (set for the session's tests only, then restored)
        if "PROTRAIN_CACHE_DIR" not in os.environ:
            patch.setenv("PROTRAIN_CACHE_DIR", str(cache))
        yield


@pytest.fixture(autouse=True, scope="session")
def _fewer_collections():
    """The collector runs less often for the session, then as before: tracing and compiling make objects by the
    million, and with Python's default thresholds a full collection, over every object the imported torch,
    transformers and sympy hold, ran every few hundred thousand of them. Objects still go once they are no longer
    referenced, cycles at the next collection; tests that need one run it. Dynamo's collection after each compile
    is off too (spawned ranks included), unless $TORCH_DYNAMO_RUN_GC_AFTER_COMPILE says otherwise."""
    thresholds = gc.get_threshold()
    collect_less()
    if "TORCH_DYNAMO_RUN_GC_AFTER_COMPILE" in os.environ:
        yield
    else:
        with pytest.MonkeyPatch.context() as patch, torch._dynamo.config.patch(run_gc_after_compile=False):
            patch.setenv("TORCH_DYNAMO_RUN_GC_AFTER_COMPILE", "0")  # (the started processes read it at import)
            yield
    gc.set_threshold(*thresholds)


@pytest.fixture(autouse=True, scope="session")
def _scalar_cpu_kernels():
    """Inductor's CPU kernels are built without SIMD for the session (spawned ranks included), unless
    $TORCHINDUCTOR_VEC_ISA_OK says otherwise: the tests check protrain's graphs, not inductor's vectoriser, and a
    scalar kernel is quicker for g++ to build, which is much of an inductor test's time on a CPU.
    Both sides of every comparison (protrain against plain `torch.compile`) are built alike."""
    if "TORCHINDUCTOR_VEC_ISA_OK" in os.environ:
        yield
        return
    from torch._inductor import config as inductor_config

    with pytest.MonkeyPatch.context() as patch, inductor_config.patch({"cpp.vec_isa_ok": False}):
        patch.setenv("TORCHINDUCTOR_VEC_ISA_OK", "0")  # (the started processes read it when they import inductor)
        yield
