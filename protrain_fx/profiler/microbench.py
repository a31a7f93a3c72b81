"""The measurements of the hardware profile (profiler/hardware.py), each a small benchmark run as the chunk runtime
runs that work.

Measured: host-to-device and device-to-host bandwidth from pinned memory, each alone and both at once; the
device's own memory bandwidth and the least time a kernel takes; the all-gather, reduce-scatter and all-reduce
time by message size for the current world size (none with one rank); the fused AdamW time per parameter on
the device, and on the host as the chunk runtime runs it (on its worker thread, with the link idle and beside
copies each way, which share the host's memory bandwidth with it: the copies' rates then are measured too),
over float32 masters and, on the device and on the idle host, bfloat16 ones; the device's AdamW on its own
stream beside matmuls on another, as persistent chunks update beside the backward (how much of its time the
matmuls hide, and how much longer it takes there); with several ranks on CUDA, all-reduces beside matmuls, as the
chunks' collectives run beside the compute (how much longer each takes there, and how much later the matmuls
end); a probe matmul's time in sustained workloads of several shares of matmuls over its time in a burst (a device
at its power limit lowers its clocks); and copying an offloaded chunk's master and AdamW states aside on the host
(to undo a clipped update); the device's memory (nvidia-ml-py where available, else `torch.cuda.mem_get_info`)
and the host's. On the CPU the same code measures CPU copies, the CPU AdamW and gloo. With several ranks the
measurements are reduced across ranks (slowest rank wins), so every rank plans from the same numbers.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from protrain_fx.distributed import rank_and_world_size
from protrain_fx.host import available_host_bytes, meminfo_bytes
from protrain_fx.host_queue import HostQueue
from protrain_fx.profiler.quiet import wait_until_children_quiet
from protrain_fx.progress import progress

log = logging.getLogger(__name__)

COPY_BYTES = 256 * 2**20  # per bandwidth measurement
ADAM_PARAMS = 64 * 2**20  # 1 GiB of fp32 state: past the caches, as a model chunk is
ADAM_TENSORS = 16  # the host AdamW's parameters, as views of one chunk (per-tensor overhead counted)
ADAM_STEPS = 3
HOST_ADAM_STEPS = 5
METHOD = 10  # how the profile is measured, in the cache key: a profile measured by older code is measured again
MATMUL_DIM = 4096  # bf16 matmuls (ROWS x DIM by DIM x DIM: `probe_matmul`) time the clocks and run beside others
BESIDE_MATMUL_ROWS = 2 * MATMUL_DIM  # the matmuls the device AdamW and the collectives are timed beside
BESIDE_MATMULS = 4  # matmul time per AdamW (or collectives') time alone: they end well inside them
BESIDE_COLLECTIVES = 4  # all-reduces timed beside matmuls
KERNELS = 1000  # back-to-back tiny kernels timed for the launch floor
# matmuls' share of the device's time in the workloads `_sustained_matmul_stretch` runs, and how long each runs
SUSTAINED_SHARES = (1.0, 0.75, 0.5, 0.25)
SUSTAINED_S = 0.8  # long enough for the power limit to set the clocks (within ~0.3 s on an H200)
SUSTAINED_TAIL = 0.4  # the last share of each workload, timed
IDLE_CYCLES = 200_000_000  # a GPU sleep of ~0.1 s at H100/H200 clocks: long enough for the clocks to rise again
COLLECTIVE_BYTES = (2**20, 16 * 2**20, 128 * 2**20)
CPU_COLLECTIVE_BYTES = (2**20, 16 * 2**20)  # gloo on a few cores: larger messages only take long (extrapolated)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def measurements(device: torch.device) -> dict:
    """Every field of a HardwareProfile but its key, measured on `device` (a collective with several ranks: every
    rank calls it) with real tensors."""
    pin = device.type == "cuda"
    if pin:  # (inductor's compile workers would take the host's cores from its AdamW: profiler/quiet.py)
        wait_until_children_quiet()
    n = COPY_BYTES // 4
    host = torch.empty(n, pin_memory=pin)
    host2 = torch.empty(n, pin_memory=pin)
    dev = torch.empty(n, device=device)
    dev2 = torch.empty(n, device=device)
    copies = {  # one copy over the link: to the device, to the host, both at once
        "h2d": lambda: dev.copy_(host, non_blocking=True),
        "d2h": lambda: host2.copy_(dev2, non_blocking=True),
        "both": _both_ways(dev, host, host2, dev2, device),
    }
    bar = progress(total=4, desc="measuring the hardware", unit="part")
    h2d, d2h = _rate(COPY_BYTES, copies["h2d"], device), _rate(COPY_BYTES, copies["d2h"], device)
    both_s = _rate(COPY_BYTES, copies["both"], device)  # each direction's, while both copy at once
    local = 2 * _rate(COPY_BYTES, lambda: dev2.copy_(dev), device)  # each byte read once and written once
    one = torch.zeros(1, device=device)
    kernel = _timed(lambda: [one.add_(1) for _ in range(KERNELS)], device) / KERNELS
    _, memory = device_facts(device)
    bar.update()
    device_adam = _adam_s_per_param(device)
    device_adam_bf16 = _adam_s_per_param(device, torch.bfloat16)
    hidden, stretch = _adam_beside_matmul(device, device_adam * ADAM_PARAMS)
    sustained = _sustained_matmul_stretch(device, dev, dev2, local)
    bar.update()
    measured = {
        "h2d_bytes_per_s": h2d,
        "d2h_bytes_per_s": d2h,
        "h2d_concurrent_bytes_per_s": both_s,
        "d2h_concurrent_bytes_per_s": both_s,
        "device_bytes_per_s": local,
        "kernel_s": kernel,
        "device_adam_s_per_param": device_adam,
        "device_adam_bf16_s_per_param": device_adam_bf16,
        "device_adam_hidden_beside_matmul": hidden,
        "device_adam_stretch_beside_matmul": stretch,
        **_host_adam(copies, device, {"h2d": h2d, "d2h": d2h, "both": both_s}),
        "host_adam_bf16_s_per_param": _host_adam_s_per_param(None, device, torch.bfloat16)[0],
        "host_undo_s_per_param": _host_undo_s_per_param(device),
    }
    bar.update()
    measured["device_memory_bytes"] = memory
    measured["host_memory_bytes"] = available_host_bytes() or 0
    collectives = _collectives(device)
    beside = _collective_beside_matmul(device)
    measured["collective_stretch_beside_matmul"], measured["matmul_delay_beside_collective"] = beside
    bar.update()
    bar.close()
    measured = _slowest_rank(measured, device)
    for k in ("device_memory_bytes", "host_memory_bytes"):
        measured[k] = int(measured[k])
    return {**measured, "collectives": collectives, "matmul_stretch_sustained": sustained}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, repeat: int = 3) -> float:
    fn()  # warm up
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeat


def _rate(nbytes: int, fn: Callable[[], object], device: torch.device) -> float:
    _together()
    return nbytes / _timed(fn, device)


def _together() -> None:
    """Wait for every rank, so that what is measured next runs on all of them at once, as in training: the ranks'
    copies and host AdamWs share the host's memory bandwidth (measured apart, each rank would time them beside
    whatever the others happened to measure)."""
    if rank_and_world_size()[1] > 1:
        dist.barrier()


def _both_ways(dev, host, host2, dev2, device: torch.device) -> Callable[[], object]:
    """One copy to the device and one back at once (on two streams on CUDA)."""
    if device.type != "cuda":
        return lambda: (dev.copy_(host), host2.copy_(dev2))
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both():
        with torch.cuda.stream(up):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(down):
            host2.copy_(dev2, non_blocking=True)

    return both


def _adam_s_per_param(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """torch's fused AdamW on the device, per parameter: the fastest of a few steps on ADAM_PARAMS parameters of
    `dtype` (with gradients and states of that dtype). On the CPU, whose ranks share the host's cores and memory
    bandwidth, every rank times it at once (`_together`)."""
    p = torch.zeros(ADAM_PARAMS, device=device, dtype=dtype)
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()  # the states are allocated in the first step
    if device.type == "cpu":
        _together()
    times = []
    for _ in range(ADAM_STEPS):
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times) / ADAM_PARAMS


def _adam_beside_matmul(device: torch.device, adam: float) -> tuple[float, float]:
    """torch's fused AdamW over ADAM_PARAMS fp32 parameters (`adam` seconds alone, `_adam_s_per_param`) on its own
    stream, started beside bf16 matmuls on the current stream that take BESIDE_MATMULS times as long as it alone
    (the median of ADAM_STEPS tries): the share of its time alone by which the two end sooner than one after the
    other, and its own time beside the matmuls over its time alone. (0.0, 1.0) off CUDA, where nothing runs
    beside."""
    if device.type != "cuda":
        return 0.0, 1.0
    p = torch.zeros(ADAM_PARAMS, device=device)
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    mm = probe_matmul(device, BESIDE_MATMUL_ROWS)
    side, main = torch.cuda.Stream(device), torch.cuda.current_stream(device)

    def elapsed(fn: Callable[[], object], stream: torch.cuda.Stream) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    opt.step()  # the states are allocated in the first step
    one = min(elapsed(mm, main) for _ in range(ADAM_STEPS))
    count = max(1, math.ceil(BESIDE_MATMULS * adam / one))

    def matmuls() -> None:
        for _ in range(count):
            mm()

    alone = min(elapsed(matmuls, main) for _ in range(ADAM_STEPS))
    hidden, stretch = [], []
    for _ in range(ADAM_STEPS):
        begin, started, ended, done = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        begin.record(main)
        matmuls()  # (queued first: the AdamW starts once they run, as an update starts inside the backward)
        side.wait_event(begin)
        with torch.cuda.stream(side):
            started.record(side)
            opt.step()
            ended.record(side)
        done.record(main)
        torch.cuda.synchronize(device)
        both = max(begin.elapsed_time(done), begin.elapsed_time(ended)) / 1e3
        hidden.append(min(1.0, max(0.0, 1 - (both - alone) / adam)))
        stretch.append(max(1.0, started.elapsed_time(ended) / 1e3 / adam))
    return statistics.median(hidden), statistics.median(stretch)


def _host_adam(copies: dict[str, Callable[[], object]], device: torch.device, rates: dict[str, float]) -> dict:
    """The host AdamW's seconds per parameter with the link idle and beside each of `copies`, and the rate of
    each copy beside it (on the CPU, where nothing is copied over a link, the AdamW's idle figure for all, and
    the copies' `rates` measured alone)."""
    idle, _ = _host_adam_s_per_param(None, device)
    measured = {"host_adam_s_per_param": idle}
    for k, fn in copies.items():
        adam, copy_s = (idle, None) if device.type != "cuda" else _host_adam_s_per_param(fn, device)
        measured[f"host_adam_{k}_s_per_param"] = adam
        measured[f"{k}_beside_host_bytes_per_s"] = rates[k] if copy_s is None else COPY_BYTES / copy_s
    return measured


def _host_adam_s_per_param(
    copies: Callable[[], object] | None, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[float, float | None]:
    """torch's fused CPU AdamW per parameter as the chunk runtime runs an offloaded chunk's step: on a HostQueue
    worker thread (one core fewer beside a GPU), over ADAM_TENSORS views of one flat pinned chunk of `dtype`, while this
    thread repeats `copies` (pinned copies over the link, waited for) or waits. The median of a few steps, and
    the median seconds of one run of `copies` meanwhile (None without). Copies slow it, and it slows copies to
    the device: both use the host's memory bandwidth."""
    gpu = device.type == "cuda"
    master = torch.zeros(ADAM_PARAMS, pin_memory=gpu, dtype=dtype)
    grads = torch.full((ADAM_PARAMS,), 1e-3, pin_memory=gpu, dtype=dtype)
    views = list(master.chunk(ADAM_TENSORS))
    for view, grad in zip(views, grads.chunk(ADAM_TENSORS)):
        view.grad = grad
    opt = torch.optim.AdamW(views, lr=1e-3, fused=True)
    adam_s, copy_s = _on_host_worker(opt.step, device, copies)  # (the first step allocates the states)
    return adam_s / ADAM_PARAMS, copy_s


def _host_undo_s_per_param(device: torch.device) -> float:
    """Keeping what an offloaded chunk's update changes (its fp32 master and two AdamW states: 12 bytes copied
    aside, `protrain_fx.optim.AdamW._snapshot`) per parameter, on a HostQueue worker thread as the runtime does it,
    with the link idle."""
    source = torch.ones(3 * ADAM_PARAMS)
    kept = torch.empty_like(source)
    return _on_host_worker(lambda: kept.copy_(source), device)[0] / ADAM_PARAMS  # (the first touches the pages)


def _on_host_worker(
    work: Callable[[], object], device: torch.device, copies: Callable[[], object] | None = None
) -> tuple[float, float | None]:
    """The median seconds of HOST_ADAM_STEPS runs of `work` after an untimed first, on a HostQueue worker thread
    (one core fewer beside a GPU) as the chunk runtime runs host work, while this thread repeats `copies` (pinned
    copies over the link, waited for) or waits; and the median seconds of a run of `copies` that ended while
    `work` still ran (None without copies)."""
    times: list[float] = []
    copy_times: list[float] = []

    def runs() -> None:
        work()
        for _ in range(HOST_ADAM_STEPS):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)

    queue = HostQueue("protrain-hardware", spare_core=device.type == "cuda")
    try:
        _together()
        done = queue.submit(0, None, runs)
        while copies is not None and not done.done():
            start = time.perf_counter()
            copies()
            _sync(device)
            if not done.done():
                copy_times.append(time.perf_counter() - start)
        done.result()
    finally:
        queue.close()
    return statistics.median(times), statistics.median(copy_times) if copy_times else None


def _collectives(device: torch.device) -> dict[str, list[tuple[int, float]]]:
    """(message bytes, seconds) per collective; nothing with one rank."""
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return {}
    out: dict[str, list[tuple[int, float]]] = {}
    for nbytes in COLLECTIVE_BYTES if device.type == "cuda" else CPU_COLLECTIVE_BYTES:
        shard = torch.zeros(nbytes // 4 // world_size, device=device)
        whole = torch.zeros(shard.numel() * world_size, device=device)
        for op, fn in _collective_calls(shard, whole, world_size).items():
            seconds = torch.tensor([_timed(fn, device)], device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            out.setdefault(op, []).append((whole.numel() * 4, float(seconds)))
    return out


def probe_matmul(device: torch.device, rows: int = MATMUL_DIM) -> Callable[[], torch.Tensor]:
    """One bf16 matmul (`rows` x MATMUL_DIM by MATMUL_DIM x MATMUL_DIM) into an output of its own: square, the
    kernel whose time tells the clocks the device runs at (`_sustained_matmul_stretch`, the profiler's probes
    between its timed nodes); of BESIDE_MATMUL_ROWS, the compute the device's AdamW and the collectives are timed
    beside."""
    a = torch.randn(rows, MATMUL_DIM, device=device, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_DIM, MATMUL_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty(rows, MATMUL_DIM, device=device, dtype=torch.bfloat16)
    return lambda: torch.mm(a, b, out=out)


def _sustained_matmul_stretch(
    device: torch.device, a: torch.Tensor, b: torch.Tensor, device_bytes_per_s: float
) -> tuple[tuple[float, float], ...]:
    """`probe_matmul`s in workloads that give them each of SUSTAINED_SHARES of the device's time, the rest copies
    from `a` to `b` (bound by memory, as fused kernels are), each run for SUSTAINED_S: the share the matmuls
    took and their median time over the workload's last SUSTAINED_TAIL, over their least time in a short burst
    after the device idled (as the profiler's probes are, profiler/interpreter.py). A device at its power limit
    lowers its clocks, more the larger the matmuls' share of its time. With several ranks: each share's mean and
    stretch's highest over the ranks. Empty off CUDA."""
    if device.type != "cuda":
        return ()
    mm = probe_matmul(device)

    def timed(copies: int, count: int) -> tuple[list[float], float]:
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
        for begin, end in marks:
            begin.record()
            mm()
            end.record()
            for _ in range(copies):
                b.copy_(a)
        torch.cuda.synchronize(device)
        tail = marks[int(count * (1 - SUSTAINED_TAIL)) :]
        return [begin.elapsed_time(end) / 1e3 for begin, end in tail], tail[0][0].elapsed_time(tail[-1][1]) / 1e3

    timed(0, 10)
    torch.cuda._sleep(IDLE_CYCLES)
    burst = min(timed(0, 25)[0])
    copy_s = 2 * a.nbytes / device_bytes_per_s
    points = []
    for share in SUSTAINED_SHARES:
        copies = round(burst * (1 - share) / share / copy_s)
        times, window = timed(copies, max(10, math.ceil(SUSTAINED_S / (burst + copies * copy_s))))
        points.append([sum(times) / window, statistics.median(times) / burst])
    _, world_size = rank_and_world_size()
    if world_size > 1:
        shares, stretches = torch.tensor(points, dtype=torch.float64, device=device).T.contiguous()
        dist.all_reduce(shares)
        dist.all_reduce(stretches, op=dist.ReduceOp.MAX)
        points = [[s / world_size, r] for s, r in zip(shares.tolist(), stretches.tolist())]
    return tuple(sorted((min(1.0, s), max(1.0, r)) for s, r in points))


def _collective_beside_matmul(device: torch.device) -> tuple[float, float]:
    """BESIDE_COLLECTIVES all-reduces of the largest of COLLECTIVE_BYTES, on a stream of their own beside bf16
    matmuls on the current stream that take BESIDE_MATMULS times as long as they do alone (the median of
    ADAM_STEPS tries), as the chunk runtime's collectives run beside the compute: their time there over their time
    alone, and by how much longer the matmuls take, per second of collective beside them. NCCL's kernels take
    cores (and memory bandwidth) from the matmuls. (1.0, 0.0) with one rank
    or off CUDA (gloo runs on the host's cores)."""
    _, world_size = rank_and_world_size()
    if world_size == 1 or device.type != "cuda":
        return 1.0, 0.0
    whole = torch.zeros(COLLECTIVE_BYTES[-1] // 4, device=device)
    mm = probe_matmul(device, BESIDE_MATMUL_ROWS)
    side, main = torch.cuda.Stream(device), torch.cuda.current_stream(device)

    def collectives() -> None:
        for work in [dist.all_reduce(whole, async_op=True) for _ in range(BESIDE_COLLECTIVES)]:
            work.wait()  # (the current stream waits for it on the device)

    alone = _timed(collectives, device)
    one = _timed(mm, device)
    counts = torch.tensor([math.ceil(BESIDE_MATMULS * alone / one)], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # (every rank's collectives run beside its matmuls throughout)
    count = int(counts)

    def matmuls() -> None:
        for _ in range(count):
            mm()

    matmuls_alone = _timed(matmuls, device)
    stretch, delay = [], []
    for _ in range(ADAM_STEPS):
        begin, ended, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        dist.barrier()
        begin.record(main)
        matmuls()
        side.wait_event(begin)
        with torch.cuda.stream(side):
            collectives()
            ended.record(side)
        done.record(main)
        torch.cuda.synchronize(device)
        beside = begin.elapsed_time(ended) / 1e3
        stretch.append(max(1.0, beside / alone))
        delay.append(max(0.0, begin.elapsed_time(done) / 1e3 - matmuls_alone) / beside)
    return statistics.median(stretch), statistics.median(delay)


def _collective_calls(shard: torch.Tensor, whole: torch.Tensor, world_size: int) -> dict[str, Callable[[], object]]:
    def reduce_scatter():
        if dist.get_backend() == "gloo":  # gloo has no reduce-scatter: the chunk runtime all-reduces instead
            return dist.all_reduce(whole)
        return dist.reduce_scatter_tensor(shard, whole)

    return {
        "all_gather": lambda: dist.all_gather(list(whole.chunk(world_size)), shard),
        "reduce_scatter": reduce_scatter,
        "all_reduce": lambda: dist.all_reduce(whole),
    }


def _slowest_rank(measured: dict[str, float], device: torch.device) -> dict[str, float]:
    """Every rank's numbers replaced by the worst rank's: the lowest rates, memory and shares hidden, the highest
    times."""
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return measured
    keys = sorted(measured)
    # each entry flipped so that MAX picks the worst (rates inverted, memory and shares negated, times as they
    # are); each flip is its own inverse
    flip = {"rate": lambda v: 1 / v, "less": lambda v: -v, "time": lambda v: v}
    kind = {
        k: "rate" if k.endswith("_per_s") else "less" if k.endswith(("_bytes", "_hidden_beside_matmul")) else "time"
        for k in keys
    }
    values = torch.tensor([flip[kind[k]](float(measured[k])) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {k: flip[kind[k]](v) for k, v in zip(keys, values.tolist())}


def device_facts(device: torch.device) -> tuple[str, int]:
    """The device's name and total memory (the host's for the CPU)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            import pynvml  # from nvidia-ml-py

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return torch.cuda.get_device_name(index), int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        except Exception as e:  # no NVML (e.g. in a container without it): torch's view of the device
            log.debug("nvidia-ml-py unavailable (%s); using torch.cuda.mem_get_info", e)
            return torch.cuda.get_device_name(index), int(torch.cuda.mem_get_info(index)[1])
    return "cpu", meminfo_bytes("MemTotal") or 0
