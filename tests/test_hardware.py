"""The hardware profile: measured on the CPU (copies, CPU AdamW, gloo), cached by key, re-measured on demand."""

import json
import os
import time

import pytest
import torch
from helpers import SMALL_HARDWARE
from spawn import gloo_rank, spawn

from protrain_fx.profiler import hardware, microbench
from protrain_fx.profiler.hardware import HardwareProfile, hardware_profile


@pytest.fixture
def small(monkeypatch):
    for name, value in SMALL_HARDWARE.items():
        monkeypatch.setattr(microbench, name, value)


def test_measured_on_cpu_and_cached(small, tmp_path, monkeypatch):
    profile = hardware_profile(torch.device("cpu"), cache_dir=tmp_path)
    rates = [profile.h2d_bytes_per_s, profile.d2h_bytes_per_s, profile.h2d_concurrent_bytes_per_s]
    assert all(r > 0 for r in rates) and profile.host_adam_s_per_param > 0
    # no link on the CPU: the host AdamW's rate is the same whatever "copies" run
    assert {profile.host_adam_s(up, down) for up in (False, True) for down in (False, True)} == {
        profile.host_adam_s_per_param
    }
    # nor does the host AdamW slow a copy there (a rate beside other copies is never above the rate alone: CPU
    # copies timed both ways at once may come out faster than one way alone)
    for way in ("h2d", "d2h"):
        for other_way in (False, True):
            assert profile.link_bytes_per_s(way, other_way, True) == profile.link_bytes_per_s(way, other_way, False)
    assert profile.link_bytes_per_s("h2d", False, True) == profile.h2d_bytes_per_s
    assert profile.link_bytes_per_s("d2h", True, True) == min(
        profile.d2h_concurrent_bytes_per_s, profile.d2h_bytes_per_s
    )
    assert profile.device_memory_bytes > 0 and profile.collectives == {}
    # nothing runs beside the CPU's AdamW (the cost model runs everything in line there)
    assert (profile.device_adam_hidden_beside_matmul, profile.device_adam_stretch_beside_matmul) == (0.0, 1.0)
    assert (profile.collective_stretch_beside_matmul, profile.matmul_delay_beside_collective) == (1.0, 0.0)
    assert profile.matmul_stretch_sustained == () and profile.sustained_matmul_stretch(1.0) == 1.0  # no clocks
    assert profile.key == hardware.cache_key(torch.device("cpu"))
    (written,) = (tmp_path / "hardware").iterdir()

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(hardware, "measure", no_measuring)
    assert hardware_profile(torch.device("cpu"), cache_dir=tmp_path) == profile  # from the cache
    with pytest.raises(AssertionError, match="measured again"):
        hardware_profile(torch.device("cpu"), cache_dir=tmp_path, remeasure=True)
    stale = json.loads(written.read_text())
    stale["key"]["torch"] = "0.0"  # measured under another key: measured again
    written.write_text(json.dumps(stale))
    with pytest.raises(AssertionError, match="measured again"):
        hardware_profile(torch.device("cpu"), cache_dir=tmp_path)


def test_a_profile_measured_by_one_of_several_local_ranks_is_not_read_by_a_rank_alone(small, tmp_path, monkeypatch):
    """Its host AdamW ran on the rank's share of the cores: four ranks' bench workers, their process group gone,
    once cached a world-size-1 profile with the host a fifth as fast as a rank alone found it, and the next run on
    one GPU planned from it (docs/benchmarks.md, twenty-second session)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shared = hardware_profile(torch.device("cpu"), cache_dir=tmp_path)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    alone = hardware_profile(torch.device("cpu"), cache_dir=tmp_path)
    assert (shared.key["host_threads"], alone.key["host_threads"]) == (2, 8)
    assert len(list((tmp_path / "hardware").iterdir())) == 2  # measured again, cached under its own key


def test_measured_with_real_tensors_under_a_fake_mode(small, tmp_path, monkeypatch):
    """The backend plans inside AOTAutograd's partitioner, under its fake mode: timing fake copies would give
    absurd rates, so the profile switches the fake mode off."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    timed = microbench._timed
    seen = []

    def checked(fn, device, repeat=3):
        seen.append(isinstance(torch.empty(1), FakeTensor))
        return timed(fn, device, repeat)

    monkeypatch.setattr(microbench, "_timed", checked)
    with FakeTensorMode():
        hardware_profile(torch.device("cpu"), cache_dir=tmp_path)
    assert seen and not any(seen)


def test_collective_time_interpolates():
    profile = HardwareProfile(
        key={}, h2d_bytes_per_s=1.0, d2h_bytes_per_s=1.0, h2d_concurrent_bytes_per_s=1.0,
        d2h_concurrent_bytes_per_s=1.0, h2d_beside_host_bytes_per_s=1.0, d2h_beside_host_bytes_per_s=1.0,
        both_beside_host_bytes_per_s=1.0, device_bytes_per_s=1.0, kernel_s=0.0,
        device_adam_s_per_param=0.0, host_adam_s_per_param=0.0, host_adam_h2d_s_per_param=0.0,
        host_adam_d2h_s_per_param=0.0, host_adam_both_s_per_param=0.0, host_undo_s_per_param=0.0,
        device_memory_bytes=0, host_memory_bytes=0,
        collectives={"all_gather": [(100, 1.0), (300, 2.0)]}, matmul_stretch_sustained=((0.5, 1.04), (1.0, 1.16)),
    )  # fmt: skip
    assert profile.collective_s("all_gather", 200) == pytest.approx(1.5)
    assert profile.collective_s("all_gather", 50) == pytest.approx(0.5)
    assert profile.collective_s("all_gather", 500) == pytest.approx(3.0)
    assert profile.collective_s("all_reduce", 500) == 0.0  # not measured: one rank
    assert HardwareProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


def _two_ranks(rank, world, port, errors):
    def body():
        for name, value in SMALL_HARDWARE.items():
            setattr(microbench, name, value)
        profile = hardware.measure(torch.device("cpu"))
        assert sorted(profile.collectives) == ["all_gather", "all_reduce", "reduce_scatter"]
        for points in profile.collectives.values():
            assert [b for b, _ in points] == [2**16, 2**20] and all(t > 0 for _, t in points)
        everyone = [None, None]
        torch.distributed.all_gather_object(everyone, profile.to_json())
        assert everyone[0] == everyone[1], "ranks must plan from the same numbers"

    gloo_rank(rank, world, port, errors, body)


def test_two_ranks_measure_collectives_and_agree():
    spawn(_two_ranks, 2)


def _late_rank(rank, world, port, errors):
    """Rank 1 reaches each host measurement half a second after rank 0; each rank notes when its host work began."""

    def body():
        for name, value in SMALL_HARDWARE.items():
            setattr(microbench, name, value)
        original, begun = microbench._on_host_worker, []

        def noted(work, device, copies=None):
            if rank == 1:
                time.sleep(0.5)
            started = []

            def work_noted():
                started.append(time.time())
                return work()

            out = original(work_noted, device, copies)
            begun.append(started[0])
            return out

        microbench._on_host_worker = noted
        hardware.measure(torch.device("cpu"))
        everyone = [None, None]
        torch.distributed.all_gather_object(everyone, begun)
        assert len(everyone[0]) == len(everyone[1]) >= 3, everyone
        skews = [abs(a - b) for a, b in zip(*everyone)]
        assert max(skews) < 0.25, skews

    gloo_rank(rank, world, port, errors, body)


def test_ranks_measure_the_host_at_once():
    """In training every rank's host AdamW runs at once, sharing the host's memory bandwidth; so the profile
    measures it on all ranks at once (measured apart, four H200 ranks' host AdamW was predicted at two thirds of
    what training measured)."""
    spawn(_late_rank, 2)


def test_host_capacity_leaves_room_for_the_rest_of_training(monkeypatch):
    """What the planner may give offloaded chunks of the host: its available memory less a reserve, and less
    each compile worker inductor may start (none where it compiles in the process), shared among the ranks."""
    from torch._inductor import config as inductor_config

    gib, cuda = 2**30, torch.device("cuda")
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: 100 * gib)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with inductor_config.patch(compile_threads=1):  # (inductor's own patching: restores its config module)
        assert hardware.host_capacity(cuda) == 100 * gib - hardware.HOST_RESERVE_BYTES
    workers = 16 * hardware.COMPILE_WORKER_BYTES
    with inductor_config.patch(compile_threads=16):
        assert hardware.host_capacity(cuda) == 100 * gib - hardware.HOST_RESERVE_BYTES - workers
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert hardware.host_capacity(cuda) == (100 * gib - 2 * (hardware.HOST_RESERVE_BYTES + workers)) // 2
        monkeypatch.setattr(hardware, "available_host_bytes", lambda: gib)
        assert hardware.host_capacity(cuda) == 0
    with inductor_config.patch(compile_threads=None):  # (not decided yet: inductor decides as it would)
        assert hardware.host_capacity(cuda) == 0
    assert hardware.host_capacity(torch.device("cpu")) is None  # (the CPU's host is budgeted only when told)


@pytest.mark.gpu
def test_pinned_blocks_torch_caches_are_given_back_before_the_host_is_budgeted():
    """A profile's `pin_memory()` copies stay in torch's caching host allocator once freed; the host capacity the
    plan reads gives them back first, so a model that fits the host with them freed is not refused."""
    copy = torch.ones(2**28, dtype=torch.uint8).pin_memory()
    torch.cuda.synchronize()
    del copy
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] >= 2**28
    assert hardware.host_capacity(torch.device("cuda")) is not None
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] < 2**28


@pytest.mark.gpu
def test_hardware_profile_on_gpu(tmp_path):
    """Pinned copies in both directions, the fused AdamW on the GPU and the CPU, the GPU's AdamW beside matmuls
    (partly hidden, and slower than alone), the card's memory from NVML."""
    profile = hardware_profile(torch.device("cuda"), cache_dir=tmp_path)
    print(profile)
    assert profile.h2d_bytes_per_s > 5e9 and profile.d2h_bytes_per_s > 5e9
    assert profile.device_adam_s_per_param < profile.host_adam_s_per_param
    assert profile.host_adam_both_s_per_param > profile.host_adam_s_per_param  # copies share the host's memory
    assert profile.both_beside_host_bytes_per_s < profile.h2d_bytes_per_s  # and the AdamW slows the copies
    assert 0 < profile.device_adam_hidden_beside_matmul < 1 and profile.device_adam_stretch_beside_matmul > 1
    # matmuls measured at four shares of the device's time, never faster than in a burst
    points = profile.matmul_stretch_sustained
    assert len(points) == 4 and all(0 < share <= 1 and stretch >= 1 for share, stretch in points)
    # NVML's total counts memory the driver keeps for itself, which cudaMemGetInfo's total leaves out
    assert profile.device_memory_bytes == pytest.approx(torch.cuda.mem_get_info()[1], rel=0.02)
