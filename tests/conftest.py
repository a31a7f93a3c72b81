import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


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
