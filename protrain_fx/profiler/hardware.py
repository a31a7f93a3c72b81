"""The hardware profile (paper §4.2 "Profiling"): what the cost models need to know about the machine, measured
once and cached on disk.

    profile = hardware_profile(torch.device("cuda"))            # measured, or read from the cache
    profile = hardware_profile(device, remeasure=True)          # measured again
    profile.collective_s("all_gather", 64 * 2**20)              # time of one collective of that many bytes

What is measured, and how: profiler/microbench.py. Here: the record (`HardwareProfile`) and what the cost models
ask of it, its cache on disk, and the GPU and host memory the planner may use (`device_capacity`, `host_capacity`).

The cache key is the device name, its memory, the world size, the host cores this rank's AdamW runs on
(`host_threads`: a rank alone has all of them, one of four local ranks a quarter), the torch version and METHOD
(profiler/microbench.py: how it is measured); a file measured under another key is measured again.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from protrain_fx.cache_dir import default_cache_dir
from protrain_fx.distributed import rank_and_world_size, same_on_every_rank, writes_machine_files
from protrain_fx.host import available_host_bytes, release_cached_pinned
from protrain_fx.host_queue import host_threads, machine_ranks
from protrain_fx.profiler.microbench import METHOD, device_facts, measurements
from protrain_fx.real_tensors import real_tensors

log = logging.getLogger(__name__)

# host memory the plan leaves to the rest of each rank's training: the process grows past what the plan counts
# (its own heap, inductor compiling in the process), and each of inductor's compile worker processes holds some
HOST_RESERVE_BYTES = 3 * 2**30
COMPILE_WORKER_BYTES = 2**28


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    key: dict
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_concurrent_bytes_per_s: float  # each direction while both copy at once (one measurement, both fields)
    d2h_concurrent_bytes_per_s: float
    # the same three while the host's AdamW runs (it shares the host's memory bandwidth with them)
    h2d_beside_host_bytes_per_s: float
    d2h_beside_host_bytes_per_s: float
    both_beside_host_bytes_per_s: float  # each direction, both copying at once
    device_bytes_per_s: float  # device memory bandwidth, read plus write (a device-to-device copy)
    kernel_s: float  # the least time a kernel takes, launched back to back (a one-element add)
    device_adam_s_per_param: float
    # the host's AdamW as the chunk runtime runs it, with the link idle and while pinned copies run to the device,
    # to the host or both ways beside it: they share the host's memory bandwidth with it
    host_adam_s_per_param: float
    host_adam_h2d_s_per_param: float
    host_adam_d2h_s_per_param: float
    host_adam_both_s_per_param: float
    # keeping what an offloaded chunk's update changes, to undo it (12 bytes copied aside: ChunkManager.speculates)
    host_undo_s_per_param: float
    device_memory_bytes: int  # total
    host_memory_bytes: int  # available when measured
    collectives: dict[str, list[tuple[int, float]]]  # op -> (message bytes, seconds), ascending; empty for 1 rank
    # the device's and the host's AdamW (link idle) over bfloat16 masters, gradients and states (the plan's
    # master_dtype "bfloat16"); None in a profile measured without them: in proportion to the bytes
    device_adam_bf16_s_per_param: float | None = None
    host_adam_bf16_s_per_param: float | None = None
    # the device's AdamW on its own stream beside matmuls on another: the share of its time alone that they hide
    # (0: they end later by all of it), and its own time there over its time alone (0 and 1: not measured)
    device_adam_hidden_beside_matmul: float = 0.0
    device_adam_stretch_beside_matmul: float = 1.0
    # with several ranks, all-reduces on their own stream beside matmuls on another: the collectives' time there
    # over their time alone, and how much later the matmuls end per second of collective beside them (1 and 0:
    # one rank, the CPU, or not measured)
    collective_stretch_beside_matmul: float = 1.0
    matmul_delay_beside_collective: float = 0.0
    # a matmul's time while the device has run a workload for a while, over its time in a short burst after the
    # device idled (as the profiler times it): (share of the device's time in matmuls, that ratio), ascending by
    # share. A device at its power limit lowers its clocks, more the more of its time goes to matmuls (empty: 1)
    matmul_stretch_sustained: tuple[tuple[float, float], ...] = ()

    def collective_s(self, op: str, nbytes: int) -> float:
        """Time of one `op` of `nbytes` (per-rank message), linear between and beyond the measured sizes."""
        points = self.collectives.get(op)
        if not points:
            return 0.0
        if len(points) == 1 or nbytes <= points[0][0]:
            return points[0][1] * nbytes / points[0][0]
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)

    def sustained_matmul_stretch(self, share: float) -> float:
        """A matmul's time in a workload that spends `share` of the device's time in matmuls, over its time as
        profiled: linear between the measured shares, 1 at share 0, the highest share's beyond it."""
        return interpolate([(0.0, 1.0), *self.matmul_stretch_sustained], share)

    def link_bytes_per_s(self, way: str, other_way: bool, host: bool) -> float:
        """The rate of copies to the device (`way` "h2d") or to the host ("d2h"), while copies run the other way
        (`other_way`) and/or the host's AdamW runs (`host`); never above the rate alone (the cost model's bound
        on a step, `CostModel.step_bound_s`, relies on it)."""
        alone = getattr(self, f"{way}_bytes_per_s")
        if other_way:
            beside = self.both_beside_host_bytes_per_s if host else getattr(self, f"{way}_concurrent_bytes_per_s")
        else:
            beside = getattr(self, f"{way}_beside_host_bytes_per_s") if host else alone
        return min(beside, alone)

    def device_adam_s(self, master_bytes: int = 4) -> float:
        """Seconds per parameter of the device's fused AdamW over masters, gradients and states of `master_bytes`
        each (4: float32, 2: bfloat16)."""
        if master_bytes == 4:
            return self.device_adam_s_per_param
        measured = self.device_adam_bf16_s_per_param
        return measured if measured is not None else self.device_adam_s_per_param * master_bytes / 4

    def host_adam_s(self, h2d: bool, d2h: bool, master_bytes: int = 4) -> float:
        """Seconds per parameter of the host's AdamW while copies run to the device (`h2d`) and/or to the host,
        over masters, gradients and states of `master_bytes` each: bfloat16's is float32's beside the same copies
        times the two's ratio with the link idle."""
        if h2d and d2h:
            fp32 = self.host_adam_both_s_per_param
        elif h2d:
            fp32 = self.host_adam_h2d_s_per_param
        else:
            fp32 = self.host_adam_d2h_s_per_param if d2h else self.host_adam_s_per_param
        if master_bytes == 4:
            return fp32
        measured = self.host_adam_bf16_s_per_param
        ratio = measured / self.host_adam_s_per_param if measured is not None else master_bytes / 4
        return fp32 * ratio

    def host_undo_s(self, master_bytes: int = 4) -> float:
        """Seconds per parameter of keeping what an offloaded chunk's update changes (a copy: by its bytes)."""
        return self.host_undo_s_per_param * master_bytes / 4

    def host_slower(self, scale: float) -> HardwareProfile:
        """This profile with all its host work (the AdamW alone and beside copies, either dtype, the undo copy)
        taking `scale` times as long."""
        host = [f.name for f in dataclasses.fields(self) if f.name.startswith("host_") and f.name.endswith("_param")]
        rates = {k: getattr(self, k) for k in host}
        return dataclasses.replace(self, **{k: v * scale for k, v in rates.items() if v is not None})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> HardwareProfile:
        data = dict(data)
        data["collectives"] = {k: [tuple(p) for p in v] for k, v in data["collectives"].items()}
        data["matmul_stretch_sustained"] = tuple(tuple(p) for p in data.get("matmul_stretch_sustained", ()))
        return cls(**data)


def cache_key(device: torch.device) -> dict:
    _, world_size = rank_and_world_size()
    name, memory = device_facts(device)
    return {
        "device": name,
        "device_memory_bytes": memory,
        "world_size": world_size,
        "host_threads": host_threads(),
        "torch": torch.__version__,
        "method": METHOD,
    }


def hardware_profile(
    device: torch.device, *, cache_dir: Path | None = None, remeasure: bool = False
) -> HardwareProfile:
    """The profile of this machine for `device`: from the cache when one was measured under the same key."""
    with real_tensors():  # real tensors, also when planning inside AOTAutograd's partitioner
        return _cached_or_measured(torch.device(device), cache_dir, remeasure)


def _cached_or_measured(device: torch.device, cache_dir: Path | None, remeasure: bool) -> HardwareProfile:
    key = cache_key(device)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache_dir or default_cache_dir()) / "hardware" / f"{digest}.json"
    cached = None if remeasure else _read(path)
    cached = cached if cached is not None and cached.key == key else None
    # each machine reads its own cache: a profile is used only where every rank read the same, so that every rank
    # plans from the same figures; else all measure (a collective), and each machine's local rank 0 writes it
    text = None if cached is None else json.dumps(cached.to_json(), sort_keys=True)
    if same_on_every_rank(text, device):
        log.info("hardware profile from %s", path)
        return cached
    if cached is not None:
        log.info("hardware profile in %s is not the one every rank has: measuring again on every rank", path)
    profile = measure(device, key)
    if writes_machine_files():  # written whole under a temporary name, then renamed: a reader never sees half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(profile.to_json(), indent=2))
        os.replace(partial, path)
        log.info("hardware profile measured and written to %s", path)
    return profile


def _read(path: Path) -> HardwareProfile | None:
    """The cached profile at `path`, or None when there is none or it cannot be read (measured again then)."""
    try:
        return HardwareProfile.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as e:
        log.warning("hardware profile cache %s unreadable (%s): measuring again", path, e)
        return None


def measure(device: torch.device, key: dict | None = None) -> HardwareProfile:
    """Measure everything (a collective with several ranks: every rank calls it)."""
    with real_tensors():
        device = torch.device(device)
        measured = measurements(device)
        return HardwareProfile(key=key or cache_key(device), **measured)


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """The value at `x` of the line through `points` ((x, y), ascending in x): the nearest end's beyond them."""
    k = bisect.bisect_right([p for p, _ in points], x)
    if k == 0 or k == len(points):
        return points[min(k, len(points) - 1)][1]
    (x0, y0), (x1, y1) = points[k - 1], points[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def device_capacity(device: torch.device) -> int | None:
    """What PyTorch may use of the device now: its free memory plus what the caching allocator holds already,
    within the process's share (`torch.cuda.set_per_process_memory_fraction`). None on the CPU, whose memory
    the planner does not budget unless told with `gpu_memory_bytes`."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    capacity = free + torch.cuda.memory_reserved(device)
    share = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # (newer torch)
    fraction = share(device) if share is not None else 1.0
    return min(capacity, int(fraction * total)) if fraction < 1 else capacity


def host_capacity(device: torch.device) -> int | None:
    """What this rank may take of the host for offloaded chunks and swap space: the host's available memory
    less what the rest of each rank's training takes of it later (HOST_RESERVE_BYTES, and COMPILE_WORKER_BYTES
    per compile worker inductor may start: `TORCHINDUCTOR_COMPILE_THREADS=1` compiles in the process and leaves
    their memory to the model), shared among this machine's ranks (torchrun's LOCAL_WORLD_SIZE; ranks started
    otherwise each count all of it). None on the CPU, where the "device" is the host and the planner does not
    budget it unless told with `host_memory_bytes`. The pinned blocks torch caches unused are given back first:
    the plan's arenas need that memory more than copies made before it."""
    if device.type != "cuda":
        return None
    released = release_cached_pinned()
    if released:
        log.info("gave back %.2f GiB of pinned host memory torch kept cached", released / 2**30)
    available = available_host_bytes()
    if available is None:
        return None
    return host_share(available, machine_ranks(), HOST_RESERVE_BYTES + compile_workers_bytes())


def host_share(available: int, ranks: int, reserve: int) -> int:
    """What each of `ranks` ranks of one machine may take of `available` host bytes for offloaded chunks and swap
    space, each rank's process keeping `reserve` bytes for the rest of its training."""
    return max(0, available - reserve * ranks) // ranks


def compile_workers_bytes() -> int:
    """The host memory `host_capacity` keeps for the compile workers inductor may start in each rank's process
    (COMPILE_WORKER_BYTES each); 0 where inductor compiles in the process (`TORCHINDUCTOR_COMPILE_THREADS=1`)."""
    from torch._inductor import config as inductor_config

    threads = inductor_config.compile_threads
    if threads is None:  # (inductor decides it at its first compile on some builds: as it will)
        decide = getattr(inductor_config, "decide_compile_threads", None)
        threads = decide() if decide is not None else 1
    return COMPILE_WORKER_BYTES * threads if threads > 1 else 0
