"""Ranks laid out as the nodes of a multi-node run (`torchrun --nnodes 2 --nproc-per-node 2`): gloo ranks on this
machine, each with the environment torchrun gives a rank of its node (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK),
and each node its own cache directory, as machines have their own disks."""

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cost_models import TWO_RANKS
from spawn import spawn_gloo

NODES, PER_NODE = 2, 2


def _as_node(rank: int, root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """This rank's environment as torchrun sets it on its node, the node's cache directory and the plan cache on;
    (node, local rank)."""
    node, local = divmod(rank, PER_NODE)
    env = {"LOCAL_RANK": local, "LOCAL_WORLD_SIZE": PER_NODE, "GROUP_RANK": node, "PROTRAIN_PLAN_CACHE": "on"}
    for name, value in {**env, "PROTRAIN_CACHE_DIR": root / f"node{node}"}.items():
        monkeypatch.setenv(name, str(value))
    return node, local


def _two_nodes(rank: int, world: int, root: str) -> None:
    from test_chunk_distributed import _train_like_eager

    from protrain_fx.distributed import same_on_every_rank
    from protrain_fx.profiler import hardware

    monkeypatch = pytest.MonkeyPatch()
    node, local = _as_node(rank, Path(root), monkeypatch)
    cpu = torch.device("cpu")
    # a measurement gives fixed figures: what is tested is which rank reads and writes them where
    figures, measured = [TWO_RANKS], []
    monkeypatch.setattr(
        hardware, "measure", lambda device, key=None: measured.append(1) or dataclasses.replace(figures[0], key=key)
    )
    first = hardware.hardware_profile(cpu)
    dist.barrier()
    files = sorted((Path(root) / f"node{node}" / "hardware").glob("*.json"))
    assert len(files) == 1, f"rank {rank}: node {node}'s cache holds {files}"  # (its local rank 0 wrote it)
    assert hardware.hardware_profile(cpu) == first and len(measured) == 1, f"rank {rank} measured again"

    # node 1's file holds other figures (measured there by another run): no rank plans from it, every rank measures
    dist.barrier()
    if node == 1 and local == 0:
        stale = json.loads(files[0].read_text())
        files[0].write_text(json.dumps({**stale, "host_adam_s_per_param": 2 * stale["host_adam_s_per_param"]}))
    dist.barrier()
    figures[0] = dataclasses.replace(TWO_RANKS, host_adam_s_per_param=3 * TWO_RANKS.host_adam_s_per_param)
    again = hardware.hardware_profile(cpu)
    assert len(measured) == 2 and again.host_adam_s_per_param == figures[0].host_adam_s_per_param, f"rank {rank}"
    assert same_on_every_rank(json.dumps(again.to_json(), sort_keys=True), cpu)
    dist.barrier()
    assert hardware.HardwareProfile.from_json(json.loads(files[0].read_text())) == again, f"node {node}'s file"

    # training on the four ranks as eager DDP does; each node keeps the graph's plan cache entry
    _train_like_eager(rank, world, "toy", {"n_persist": 1, "n_buffer": 2}, "gloo", "cpu")
    dist.barrier()
    assert list((Path(root) / f"node{node}" / "plans").glob("*.json")), f"node {node} kept no plan"
    monkeypatch.undo()


def test_ranks_laid_out_as_two_nodes(tmp_path):
    """Each node's local rank 0 writes its hardware profile and plan cache; a cached hardware profile is used only
    where every rank read the same (else each node could plan from its own figures), and the ranks train like
    eager DDP."""
    spawn_gloo(functools.partial(_two_nodes, root=str(tmp_path)), NODES * PER_NODE)
