"""One system's training run, in its own process: build, compile, train, measure, emit one JSON line.

Measured: the median step time over the timed steps (those after `warmup`; the first warmup step
includes compilation), tokens/s from it, peak GPU memory (`torch.cuda.max_memory_allocated`, reset
after the model is built), peak host RSS of this process (`ru_maxrss`; inductor's compile workers
are other processes and not counted), and the loss of every step. From the step time: TFLOP/s (6 N per
token, and with the forward of recomputed blocks counted again) and MFU against this device's measured
matmul rate (bench/flops.py). Then a few more steps, synchronized between phases, split the step into
forward, backward and optimizer (synchronizing removes overlap between them, and protrain's host updates
that run on past `optimizer.step()` are not in it: the split is a guide, the step time is the figure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from bench.flops import decoder_layers, matmul_tflops, parameter_count, step_flops
from bench.model import (
    DTYPES,
    ModelSpec,
    build_deepspeed_model,
    build_fsdp2_model,
    build_prepared_model,
    finetune_batches,
    random_batches,
    resolve_init,
)
from bench.text import text_batches

log = logging.getLogger(__name__)

FSDP2_SYSTEMS = ("fsdp2-offload", "fsdp2-offload-ac")  # FSDP2 with CPU offload (-ac: and activation checkpointing)
# DeepSpeed ZeRO-3 with parameters and AdamW on the host (-ac: and activation checkpointing), where it is installed
DEEPSPEED_SYSTEMS = ("deepspeed-offload", "deepspeed-offload-ac")
# compile-amp: torch.compile over fp32 weights (the masters) under bf16/fp16 autocast, with fp32 AdamW: the
# numerics of protrain's default fp32 masters, where compile trains the weights in the compute dtype itself
# where protrain-chunks' model is built (`train`); "auto": as its user would (`resolve_init`)
INITS = ("auto", "gpu", "cpu", "meta")
FINETUNE_DATA = ("finetune", "finetune-padded")  # bench/model.py: finetune_batches
SYSTEMS = ("protrain", "protrain-chunks", "compile", "compile-amp", "eager", *FSDP2_SYSTEMS, *DEEPSPEED_SYSTEMS)
RESULT_PREFIX = "BENCH_RESULT "  # marks the worker's result line on stdout; anything else there is ignored
LR = 1e-4


@dataclasses.dataclass
class Result:
    system: str
    device: str
    torch_version: str
    params: int
    tokens_per_s: float
    step_time_s: float
    peak_gpu_bytes: int | None
    peak_rss_bytes: int
    loss_first: float
    loss_last: float
    step_times_s: list[float]
    losses: list[float]
    tflops: float  # 6 N tokens per step time
    tflops_recompute: float  # with recomputed blocks' forward counted
    matmul_tflops: float  # this device's measured rate on a large matmul of the compute dtype
    mfu: float  # tflops / matmul_tflops
    breakdown_s: dict[str, float]  # median forward, backward, optimizer seconds of synchronized steps
    world_size: int  # ranks training together (torchrun); tokens/s and TFLOP/s are their total
    plan: dict | None = None  # protrain: the plan in force (`protrain_fx.plan_of(...).to_json()`, no runners-up)
    # protrain: the hardware profile its plan was searched with (HardwareProfile.to_json(), from the cache), so a
    # prediction that misses on one machine can be traced to the figures it read there
    hardware: dict | None = None
    clip: float = 0.0  # the gradient norm clipped to before each step (0: none)
    memory_budget: float = 1.0  # compile's activation_memory_budget (1.0: its default)
    init: str = "gpu"  # built on the GPU, or (protrain-chunks) on the CPU or meta device and prepared (INITS)
    # protrain: seconds of each compile phase summed over graphs (backend/phases.py), "cache" where the plan cache
    # gave its result
    phases_s: dict | None = None


def unavailable(system: str) -> str | None:
    """Why `system` cannot run on this machine, None where it can: DeepSpeed's needs its package."""
    if system in DEEPSPEED_SYSTEMS and importlib.util.find_spec("deepspeed") is None:
        return "the deepspeed package is not installed (pip install deepspeed)"
    return None


def wrap(
    model: nn.Module,
    system: str,
    plan: dict | None = None,
    dump_dir: str | None = None,
    executor: str = "inductor",
    gpu_memory_bytes: int | None = None,
    replan: str = "off",
    dynamic: bool | None = None,
) -> nn.Module:
    # (the closed loop is off unless asked for: a re-plan would switch plans within the timed steps; a JSON list
    # puts those plans in force in turn)
    turns = json.loads(replan) if replan.startswith("[") else replan
    options: dict = {"replan": turns, **({"dump_dir": dump_dir} if dump_dir else {})}
    if executor != "inductor":  # (the eager FX executor: CPU smoke runs)
        options["executor"] = executor
    if gpu_memory_bytes:  # (also where torch has no get_per_process_memory_fraction for the planner to read)
        options["gpu_memory_bytes"] = gpu_memory_bytes
    if system == "protrain":
        return torch.compile(model, backend="protrain", options=options, dynamic=dynamic)  # everything searched
    if system == "protrain-chunks":  # model states in chunks (protrain_fx.optim.AdamW), plan forced by --plan
        return torch.compile(model, backend="protrain", options={"plan": plan or {}, **options}, dynamic=dynamic)
    if system in ("compile", "compile-amp"):
        return torch.compile(model, dynamic=dynamic)
    if system == "eager" or system in FSDP2_SYSTEMS or system in DEEPSPEED_SYSTEMS:
        return model
    raise ValueError(f"unknown system {system!r}; choose from {list(SYSTEMS)}")


def train(
    system: str,
    spec: ModelSpec,
    *,
    batch: int,
    steps: int,
    warmup: int,
    dtype: str,
    seed: int,
    data: str = "random",
    plan: dict | None = None,
    dump_dir: str | None = None,
    executor: str = "inductor",
    clip: float = 0.0,
    gpu_memory_gib: float = 0.0,
    memory_budget: float = 1.0,
    init: str = "auto",
    replan: str = "off",
) -> Result:
    """Train `warmup + steps` AdamW steps of the model under `system` and measure them. `data`: "random"
    tokens or byte tokens of real "text" (bench/text.py). `clip` > 0: clip the gradient norm to it between
    backward and step. `gpu_memory_gib` > 0: the GPU memory the system may use (`limit_gpu_memory`).
    `memory_budget` < 1: compile and compile-amp keep at most that share of the activations, recomputing the
    cheapest rest (`torch._functorch.config.activation_memory_budget`, for this run only). `init` "cpu" or "meta":
    protrain-chunks' model is built there and put into chunks by `protrain_fx.prepare` (a model larger than the
    GPU is built so), "gpu": on the GPU, "auto": as a user would (`resolve_init`). `replan` "on": protrain's closed
    loop (its option of that name), which switches plans after its measured steps: `warmup` must cover them; a
    JSON list of plans: those put in force in turn (`bench predict --in-turn`)."""
    if init not in INITS or (init not in ("gpu", "auto") and system != "protrain-chunks"):
        raise ValueError(f"--init {init!r}: one of {INITS}, and 'cpu' or 'meta' only for protrain-chunks")
    if not 0 < memory_budget <= 1:
        raise ValueError(f"--memory-budget must be in (0, 1], got {memory_budget}")
    budgeted = system in ("compile", "compile-amp") and memory_budget < 1
    budget = (
        torch._functorch.config.patch(activation_memory_budget=memory_budget) if budgeted else contextlib.nullcontext()
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    limit = int(gpu_memory_gib * 2**30)
    if limit > 0:
        limit_gpu_memory(device, limit)
    init = resolve_init(init, system == "protrain-chunks", spec, DTYPES[dtype], device, limit)
    sharded = system in FSDP2_SYSTEMS or system in DEEPSPEED_SYSTEMS  # (they need a process group)
    distributed = sharded or int(os.environ.get("WORLD_SIZE", 1)) > 1  # (torchrun sets it)
    phases: dict[str, float | str] = {}
    with _process_group(device) if distributed else contextlib.nullcontext(), budget, _phase_times(phases):
        world = dist.get_world_size() if dist.is_initialized() else 1
        model, opt = _model_and_optimizer(system, spec, device, DTYPES[dtype], seed, batch=batch, clip=clip, init=init)
        params = parameter_count(model)
        log.info("%s: %.1fM parameters, %s on %s", system, params / 1e6, dtype, _device_name(device))
        dynamic = True if data == "finetune" else None  # (many lengths: one graph with symbolic sizes from the start)
        step_model = wrap(model, system, plan, dump_dir, executor, limit, replan, dynamic)
        forward = _forward(system, step_model, device, DTYPES[dtype])
        backward = _backward(system, model, clip)
        real = None  # each batch's real (unpadded) tokens, for data of many lengths
        if data == "text":
            batches = text_batches(spec.seq, batch, warmup + steps, device, seed)
        elif data in FINETUNE_DATA:
            batches, real = finetune_batches(spec, batch, warmup + steps, device, seed, pad=data == "finetune-padded")
        else:
            batches = random_batches(spec, batch, warmup + steps, device, seed)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

        times, losses = [], []
        for ids in (bar := tqdm(batches, desc=system, unit="step", file=sys.stderr)):
            _sync(device)
            start = time.perf_counter()
            loss = forward(ids)
            backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}", step_s=f"{times[-1]:.3f}")

        breakdown = _breakdown(forward, opt, batches[-BREAKDOWN_STEPS:], device, backward)
        plan_in_force = _plan_in_force(system, step_model)
        module = _module(system, model)
        recomputed = _recomputed_blocks(system, plan_in_force, module)
        flops, flops_recompute = step_flops(module, batch * spec.seq, recomputed)
        compute_dtype = DTYPES[dtype] if cuda else torch.float32  # (bf16 matmuls on a CPU are not its peak)
        peak = matmul_tflops(device, compute_dtype)
        hardware = _hardware_profile(system, device)  # (in the process group: its world size is the cache key's)

    diverged = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    if diverged is not None:
        log.warning("%s: the loss is %s from step %d on (counting from 0)", system, losses[diverged], diverged)
    step_time = statistics.median(times[warmup:])
    # data of many lengths: real tokens over the measured steps' time (a median step says little there)
    tokens_per_s = world * sum(real[warmup:]) / sum(times[warmup:]) if real else world * batch * spec.seq / step_time
    return Result(
        system=system,
        device=_device_name(device),
        torch_version=torch.__version__,
        params=params,
        tokens_per_s=tokens_per_s,
        step_time_s=step_time,
        peak_gpu_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
        loss_first=losses[0],
        loss_last=losses[-1],
        step_times_s=times,
        losses=losses,
        tflops=world * flops / step_time / 1e12,
        tflops_recompute=world * flops_recompute / step_time / 1e12,
        matmul_tflops=peak,
        mfu=flops / step_time / 1e12 / peak,  # per device
        breakdown_s=breakdown,
        world_size=world,
        plan=plan_in_force,
        hardware=hardware,
        phases_s=phases or None,
        clip=clip,
        memory_budget=memory_budget if budgeted else 1.0,
        init=init,
    )


BREAKDOWN_STEPS = 3


def limit_gpu_memory(device: torch.device, nbytes: int) -> None:
    """Let this process's caching allocator hold at most `nbytes` of `device` (a smaller GPU on a larger one,
    for every system alike; protrain's planner reads the limit as its capacity: profiler/hardware.py
    device_capacity)."""
    if device.type != "cuda":
        raise ValueError("--gpu-memory-gib limits a CUDA device's memory; this run has none")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if nbytes > total:
        raise ValueError(f"--gpu-memory-gib asks for {nbytes / 2**30:.1f} GiB; this GPU has {total / 2**30:.1f}")
    torch.cuda.set_per_process_memory_fraction(nbytes / total, index)


def _forward(system: str, step_model: nn.Module, device: torch.device, dtype: torch.dtype):
    """`forward(ids)`: the loss of a batch (compile-amp: under autocast to `dtype`)."""
    if system != "compile-amp":
        return lambda ids: step_model(input_ids=ids, labels=ids).loss

    def forward(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            return step_model(input_ids=ids, labels=ids).loss

    return forward


def _backward(system: str, model: nn.Module, clip: float):
    """`backward(loss)`: the backward pass, then, with `clip` > 0, the system's gradient-norm clipping (DeepSpeed's
    engine: its own backward, and it clips in its step)."""
    if system in DEEPSPEED_SYSTEMS:
        return model.backward
    if clip <= 0:
        return lambda loss: loss.backward()
    if system.startswith("protrain"):
        import protrain_fx

        clip_grad_norm_ = functools.partial(protrain_fx.clip_grad_norm_, model)
    else:
        clip_grad_norm_ = functools.partial(torch.nn.utils.clip_grad_norm_, list(model.parameters()))

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        clip_grad_norm_(clip)

    return backward


def _breakdown(forward, opt, batches: list[torch.Tensor], device: torch.device, backward) -> dict:
    """Median seconds of forward, backward (with clipping) and optimizer over steps synchronized between the
    phases."""
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for ids in batches:
        marks = [_now(device)]
        loss = forward(ids)
        marks.append(_now(device))
        backward(loss)
        marks.append(_now(device))
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(_now(device))
        for times, a, b in zip(phases.values(), marks, marks[1:]):
            times.append(b - a)
    return {name: statistics.median(times) for name, times in phases.items()}


def _now(device: torch.device) -> float:
    _sync(device)
    return time.perf_counter()


def _plan_in_force(system: str, step_model: nn.Module) -> dict | None:
    """protrain's plan (its fields and predictions; runners-up left out), None for other systems or no plan."""
    if not system.startswith("protrain"):
        return None
    import protrain_fx

    try:
        plan = protrain_fx.plan_of(step_model)
    except ValueError:  # no plan (no graph was planned)
        return None
    return {k: v for k, v in plan.to_json().items() if k != "runners_up"}


def _hardware_profile(system: str, device: torch.device) -> dict | None:
    """The hardware profile protrain planned with (read from its cache: measured by then), None for others."""
    if not system.startswith("protrain"):
        return None
    from protrain_fx.profiler.hardware import hardware_profile

    return hardware_profile(device).to_json()


def _recomputed_blocks(system: str, plan: dict | None, model: nn.Module) -> int:
    """Blocks whose forward runs again in the backward: protrain's plan (its checkpointed blocks; a selective
    block recomputes no matmul), or every block under FSDP2 or DeepSpeed with activation checkpointing."""
    if plan is not None:
        return plan["n_checkpoint"]
    return len(decoder_layers(model)) if system.endswith("-ac") else 0


def emit(result: dict) -> None:
    """Write the result line the parent `compare` process reads back."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _model_and_optimizer(
    system: str,
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    *,
    batch: int,
    clip: float,
    init: str = "gpu",
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model to train and what the loop calls `step()` and `zero_grad()` on (DeepSpeed: its engine, whose step
    updates and clears the gradients)."""
    if system in DEEPSPEED_SYSTEMS:
        engine, _ = build_deepspeed_model(
            spec, dtype, seed, batch=batch, lr=LR, clip=clip, checkpoint=system.endswith("-ac")
        )
        return engine, _EngineStep(engine)
    if system in FSDP2_SYSTEMS:
        model = build_fsdp2_model(spec, device, dtype, seed, checkpoint=system == "fsdp2-offload-ac")
        try:  # over the sharded fp32 parameters on the host: torch's fused CPU AdamW (torch >= 2.4)
            return model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        except (RuntimeError, ValueError) as e:
            log.warning("fused AdamW refused (%s); using foreach", e)
            return model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    model = build_prepared_model(spec, device, torch.float32 if system == "compile-amp" else dtype, seed, init)
    if system == "protrain-chunks":
        import protrain_fx

        return model, protrain_fx.optim.AdamW(model.parameters(), lr=LR)
    fused_or_foreach = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return model, torch.optim.AdamW(model.parameters(), lr=LR, **fused_or_foreach)


class _EngineStep:
    """A DeepSpeed engine as the training loop's optimizer: `step()` is the engine's, which also clears the
    gradients, so `zero_grad` has nothing to do."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _module(system: str, model: nn.Module) -> nn.Module:
    """The Hugging Face model itself (DeepSpeed's engine holds it as `module`)."""
    return model.module if system in DEEPSPEED_SYSTEMS else model


@contextlib.contextmanager
def _process_group(device: torch.device) -> Iterator[None]:
    """A process group for FSDP2, unless one exists: torchrun's environment if set, else this one process alone."""
    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for name in ("RANK", "LOCAL_RANK"):  # (torchrun's, which DeepSpeed reads too)
        os.environ.setdefault(name, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    try:
        yield
    except BaseException:
        # not torn down: that waits for the collectives the other ranks are in, hiding the error behind a hang; the
        # process ends with it, and torchrun stops the other ranks
        log.exception("rank %d failed", rank)
        raise
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _PhaseHandler(logging.Handler):
    """Collects protrain's progress lines (backend/phases.py) into `phases`: seconds per phase over all graphs."""

    def __init__(self, phases: dict[str, float | str]) -> None:
        super().__init__(logging.INFO)
        self.phases = phases

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 3 and isinstance(args[2], float):  # "graph %d: %s in %.2f s"
            self.phases[args[1]] = self.phases.get(args[1], 0.0) + args[2]
        elif len(args) == 3 and "plan cache" in record.msg:  # "graph %d: %s from the plan cache (%s)"
            self.phases[{"profile": "profiled", "plan": "searched"}.get(args[1], args[1])] = "cache"


@contextlib.contextmanager
def _phase_times(phases: dict[str, float | str]) -> Iterator[None]:
    from protrain_fx.backend.phases import PROGRESS_LOGGER

    logger, handler = logging.getLogger(PROGRESS_LOGGER), _PhaseHandler(phases)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
