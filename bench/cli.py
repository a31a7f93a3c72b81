"""`python -m bench compare` (the table), `predict`, `from-dump`, `stability`, `sweep`, `maxsize`, `scaling`, `plot`
(bench/predict.py, bench/stability.py, bench/sweep.py, bench/plot.py) and `python -m bench worker` (one system's
run, in its own process, started by the others) and `profile` (one profile and plan, started by `stability`)."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import importlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from bench.model import DTYPES, FAMILIES, PRESET_PARAMS, PRESETS, ModelSpec, preset
from bench.plot import plot
from bench.sweep import maxsize, scaling, sweep
from bench.table import table
from bench.trainer import TRAINER_SYSTEMS, trainer
from bench.worker import INITS, RESULT_PREFIX, SYSTEMS, emit, train, unavailable

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_FLAGS = {"batch": 8, "steps": 20, "warmup": 3, "seed": 0}  # with ModelSpec's fields: forwarded to workers
GiB = 2**30


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "preset"):  # (plot: no run)
        return args.func(args)
    # the family's preset fills the sizes not given
    for name, size in dataclasses.asdict(preset(args.preset, args.family or "llama")).items():
        if getattr(args, name) is None:
            setattr(args, name, size)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"need --steps >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    return args.func(args)


def compare(args: argparse.Namespace) -> int:
    """Run every selected system in its own worker process; print the table, write the JSON."""
    results = []
    for system in parse_systems(args.systems):
        why = unavailable(system)
        results.append({"system": system, "skipped": why} if why else _run_worker(system, args))
    ratio = _ratio(results)

    print(format_table(results))
    if ratio is not None:
        print(f"ratio-check: protrain tokens/s / compile tokens/s = {ratio:.3f}")
    if args.out:
        report = {
            "command": shlex.join(["python", "-m", "bench", *sys.argv[1:]]),
            "commit": _git_commit(),
            "device": next((r["device"] for r in results if "device" in r), None),
            "torch_version": next((r["torch_version"] for r in results if "torch_version" in r), None),
            "args": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
            "ratio_protrain_over_compile": ratio,
            "results": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        log.info("wrote %s", args.out)
    return 1 if any("error" in r for r in results) else 0


def parse_systems(text: str) -> list[str]:
    """The comma-separated `--systems`, checked. Those that cannot run on this machine (`unavailable`) are logged
    as skipped, with why; `compare` reports them so, the other commands leave them out."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown} in --systems; choose from {list(SYSTEMS)}")
    for system in systems:
        if why := unavailable(system):
            log.warning("%s skipped: %s", system, why)
    return systems


def runnable(systems: list[str]) -> list[str]:
    """Those of `systems` this machine can run."""
    return [s for s in systems if not unavailable(s)]


def worker(args: argparse.Namespace) -> int:
    # `kill -USR1 <pid>` (or `timeout -s USR1`): every thread's stack to stderr, also from inside a compile or a wait
    # in native code, where an interrupt prints nothing
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = ModelSpec.from_args(args)
    try:
        names = (
            "batch",
            "steps",
            "warmup",
            "dtype",
            "seed",
            "data",
            "executor",
            "clip",
            "gpu_memory_gib",
            "memory_budget",
            "init",
            "replan",
        )
        run = {name: getattr(args, name) for name in names}
        result = train(args.system, spec, plan=json.loads(args.plan), dump_dir=args.dump_dir or None, **run)
    except Exception as e:
        emit({"system": args.system, "error": f"{type(e).__name__}: {e}"})
        raise
    if int(os.environ.get("RANK", 0)) == 0:  # under torchrun, rank 0 reports for all
        emit(dataclasses.asdict(result))
    return 0


def format_table(results: list[dict]) -> str:
    header = (
        "system",
        "tokens/s",
        "step ms",
        "TFLOP/s",
        "MFU",
        "fwd/bwd/opt ms",
        "peak GPU GiB",
        "peak RSS GiB",
        "loss first",
        "loss last",
        "params M",
    )
    return table([header, *(_row(r) for r in results)])


def _row(r: dict) -> tuple[str, ...]:
    if "error" in r:
        return r["system"], "FAILED: " + " ".join(r["error"].split())  # one line, whatever the message
    if "skipped" in r:
        return r["system"], "SKIPPED: " + r["skipped"]
    gpu = "-" if r["peak_gpu_bytes"] is None else f"{r['peak_gpu_bytes'] / GiB:.2f}"
    speed = f"{r['tokens_per_s']:.1f}", f"{r['step_time_s'] * 1e3:.1f}"
    tflops = f"{r['tflops']:.1f}" + (f" ({r['tflops_recompute']:.1f})" if r["tflops_recompute"] > r["tflops"] else "")
    split = "/".join(f"{s * 1e3:.0f}" for s in r["breakdown_s"].values())
    losses = f"{r['loss_first']:.4f}", f"{r['loss_last']:.4f}"
    memory = gpu, f"{r['peak_rss_bytes'] / GiB:.2f}"
    return r["system"], *speed, tflops, f"{r['mfu']:.1%}", split, *memory, *losses, f"{r['params'] / 1e6:.1f}"


def _run_worker(system: str, args: argparse.Namespace, nproc: int = 1) -> dict:
    """One system's run in a worker process; with `nproc` > 1, that many ranks under torchrun."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
    cmd = [*(launch if nproc > 1 else [sys.executable, "-m"]), "bench", "worker", "--system", system]
    return run_for_result([*cmd, *worker_flags(args)], system)


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The flags that pass `args`' model sizes and run settings on to a worker process."""
    flags = [*dataclasses.asdict(ModelSpec()), *RUN_FLAGS]
    cmd = ["--dtype", args.dtype, "--plan", args.plan, "--data", args.data, "--executor", args.executor]
    cmd += ["--dump-dir", args.dump_dir, "--clip", str(args.clip), "--gpu-memory-gib", str(args.gpu_memory_gib)]
    cmd += ["--memory-budget", str(args.memory_budget), "--init", args.init, "--replan", args.replan]
    return cmd + [arg for name in flags for arg in (_flag(name), str(getattr(args, name)))]


def run_for_result(cmd: list[str], system: str, env: dict[str, str] | None = None) -> dict:
    """Run a worker's command line (in `env`, else this process's environment); its result line (RESULT_PREFIX) as
    a dict, or the error where it gave none."""
    log.info("running %s", shlex.join(cmd))
    # stderr (tqdm, logs) passes through
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        return {"system": system, "error": f"worker exited with code {proc.returncode} and no result; see its stderr"}
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def _flag(name: str) -> str:
    """The command-line flag of a ModelSpec field or run setting: `kv_heads` is `--kv-heads`."""
    return "--" + name.replace("_", "-")


def _ratio(results: list[dict]) -> float | None:
    by_system = {r["system"]: r for r in results if "tokens_per_s" in r}
    if "protrain" in by_system and "compile" in by_system:
        return by_system["protrain"]["tokens_per_s"] / by_system["compile"]["tokens_per_s"]
    return None


def _git_commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None  # None before the first commit


def _preset_help() -> str:
    counts = "; ".join(
        f"{name}: " + ", ".join(f"{family} {params[name] / 1e9:.2f}B" for family, params in PRESET_PARAMS.items())
        for name in PRESETS
    )
    return f"model sizes in the family's proportions (default 1b), parameters: {counts}"


def _sizes() -> argparse.ArgumentParser:
    """The model size and run flags, a new parser for each command: commands given one parent share its flags'
    objects, and one command's `set_defaults` (maxsize's 3 steps) then changed every command's defaults."""
    sizes = argparse.ArgumentParser(add_help=False)
    sizes.add_argument("--preset", choices=list(PRESETS), default="1b", help=_preset_help())
    for name in dataclasses.asdict(ModelSpec()):
        if name == "family":
            sizes.add_argument(
                "--family",
                choices=FAMILIES,
                help="architecture (default llama; bench/model.py): qwen2 has grouped-query attention, gpt_neox "
                "parallel attention and MLP with a GELU MLP and LayerNorms",
            )
            continue
        presets = ", ".join(f"{getattr(spec, name)} with {name_}" for name_, spec in PRESETS.items())
        what = "key/value heads of grouped-query attention, 0: one per head; " if name == "kv_heads" else ""
        sizes.add_argument(_flag(name), type=int, help=f"{what}overrides the preset's (llama: {presets})")
    for name, default in RUN_FLAGS.items():
        sizes.add_argument(f"--{name}", type=int, default=default, help=f"(default {default})")
    sizes.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="bfloat16",
        help="weight dtype; for fsdp2-* the compute dtype, weights fp32 (default bfloat16)",
    )
    sizes.add_argument(
        "--data",
        choices=["random", "text", "finetune", "finetune-padded"],
        default="random",
        help="uniform random tokens, byte tokens of real text (docstrings of installed code; bench/text.py), or "
        "random tokens in batches of fine-tuning-like lengths, 64 to --seq (finetune: each batch padded to its "
        "longest, protrain compiled with dynamic shapes; finetune-padded: every batch to --seq); tokens/s counts "
        "the real tokens",
    )
    sizes.add_argument(
        "--executor", choices=["inductor", "eager"], default="inductor", help="protrain's executor (default inductor)"
    )
    sizes.add_argument(
        "--replan",
        type=_replan,
        default="off",
        help="protrain's closed loop (option 'replan'): 'on' re-plans once from the first measured steps, so "
        "--warmup must cover them and the switch (10 steps); default off: the first plan is timed; a JSON list of "
        "plans: each put in force in turn after the first's measured steps (bench predict --in-turn)",
    )
    sizes.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="clip the gradient norm to this before each optimizer step (protrain_fx.clip_grad_norm_ or torch's); "
        "0: no clipping (default)",
    )
    sizes.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=0.0,
        help="GiB of the GPU each system may use (torch.cuda.set_per_process_memory_fraction; protrain plans for "
        "it), e.g. 79.6 for an 80 GB H100 on a larger GPU; 0: all of it (default)",
    )
    sizes.add_argument(
        "--memory-budget",
        type=float,
        default=1.0,
        help="compile and compile-amp: torch._functorch.config.activation_memory_budget, the share of the "
        "activations the min-cut partitioner may keep (it recomputes the cheapest rest); 1.0: its default (default)",
    )
    sizes.add_argument(
        "--init",
        choices=INITS,
        default="auto",
        help="protrain-chunks: build the model on the GPU, or on the CPU or the meta device and put it into "
        "chunks with protrain_fx.prepare, as a model larger than the GPU is; auto: on the GPU where its weights "
        "take at most half of the GPU memory, else on meta (default auto)",
    )
    sizes.add_argument("--dump-dir", default="", help="protrain's dump directory (protrain systems; '' for none)")
    sizes.add_argument(
        "--plan",
        default="{}",
        help="JSON plan fields forced on protrain-chunks, e.g. '{\"n_persist\": 4}'; '{\"n_selective\": 0}' searches "
        "without selective blocks",
    )
    return sizes


def _plan_list(value: str) -> str:
    """A JSON list of plan dicts (--plans, --replan), checked and kept as the string: a worker is passed it as it is."""
    try:
        plans = json.loads(value)
    except json.JSONDecodeError:
        plans = None
    if not isinstance(plans, list) or not all(isinstance(p, dict) for p in plans):
        raise argparse.ArgumentTypeError(
            f"a JSON list of plan dicts, e.g. '[{{}}, {{\"n_persist\": 4}}]', got {value!r}"
        )
    return value


def _replan(value: str) -> str:
    """--replan: 'on', 'off', or a JSON list of plan dicts."""
    if value in ("on", "off"):
        return value
    try:
        return _plan_list(value)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"'on', 'off' or {error}") from None


def _lazy(module: str, name: str):
    """`bench.<module>.<name>`, imported when its command runs: predict and stability import protrain_fx, which
    the other commands' processes (sweep's, scaling's, an eager worker) need not pay for."""
    return getattr(importlib.import_module(f"bench.{module}"), name)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("compare", parents=[_sizes()], help="train with each system in its own process; print a table")
    p.add_argument("--systems", default="protrain,compile,eager", help=f"comma-separated, from {list(SYSTEMS)}")
    p.add_argument("--out", default="out/compare.json", help="where the JSON report goes ('' for none)")
    p.set_defaults(func=compare)
    p = sub.add_parser("predict", parents=[_sizes()], help="predicted vs measured step time and peak memory of plans")
    p.add_argument(
        "--plans", type=_plan_list, default="[{}]", help="JSON list of plans forced on protrain-chunks ({} searches)"
    )
    p.add_argument("--out", default="out/predict.json", help="where the JSON report goes ('' for none)")
    p.add_argument("--keep-dumps", default="", help="keep each plan's dump directory here, as plan<i>")
    p.add_argument("--nproc", type=int, default=1, help="ranks under torchrun, one GPU each; rank 0's graphs report")
    p.add_argument("--rounds", type=int, default=1, help="run the plan list this many times over, in turn (default 1)")
    p.add_argument(
        "--in-turn",
        action="store_true",
        help="run the plans one after another in one process (protrain's option 'replan' as a list): the first "
        "compiled, each of the others switched to after the one before has measured its steps; one process a round",
    )
    p.set_defaults(func=lambda args: _lazy("predict", "predict")(args))
    p = sub.add_parser("from-dump", help="dumped graphs planned again by the current planner, against their steps")
    p.add_argument("dumps", nargs="+", help="dump directories (every rank<r>/graph<k> below is planned again)")
    p.add_argument("--plan", default="", help="JSON plan fields to force instead of the dumped ones")
    p.add_argument(
        "--host-as-measured",
        action="store_true",
        help="time the dumped plan with the host AdamW as fast as training measured it (where it did)",
    )
    p.set_defaults(func=lambda args: _lazy("predict", "from_dump")(args))
    p = sub.add_parser(
        "stability", parents=[_sizes()], help="how far a model's plan and predicted step move between its profiles"
    )
    p.add_argument("--profiles", type=int, default=2, help="profiles to take, each in a process of its own (default 2)")
    p.add_argument("--dumps", nargs="*", default=[], help="dump directories of one model to compare, not profiling it")
    p.add_argument(
        "--plans",
        type=_plan_list,
        default="[]",
        help="JSON list of plans to time in every profile, besides the searched",
    )
    p.add_argument(
        "--capacities",
        default="",
        help="comma-separated shares of the way from the least memory a plan needs to all chunks persistent, to plan "
        "every profile under too, e.g. 1,0.7,0.4 ('' for none)",
    )
    p.add_argument("--remeasure-hardware", action="store_true", help="each profile measures the hardware again")
    p.add_argument("--keep-dumps", default="", help="keep each profile's dump directory here, as profile<i>")
    p.add_argument("--out", default="out/stability.json", help="where the JSON report goes ('' for none)")
    p.set_defaults(func=lambda args: _lazy("stability", "stability")(args))
    p = sub.add_parser("profile", parents=[_sizes()], help="one profile and plan of the model (started by stability)")
    p.add_argument("--remeasure-hardware", action="store_true", help="measure the hardware profile again first")
    p.set_defaults(func=lambda args: _lazy("stability", "profile_worker")(args))
    p = sub.add_parser("sweep", parents=[_sizes()], help="tokens/s of each system across batch sizes")
    p.add_argument("--systems", default="protrain,compile,eager", help=f"comma-separated, from {list(SYSTEMS)}")
    p.add_argument("--batches", default="4,8,16,32", help="comma-separated batch sizes (default 4,8,16,32)")
    p.add_argument("--out", default="out/sweep.json", help="where the JSON report goes ('' for none)")
    p.set_defaults(func=sweep)
    p = sub.add_parser("maxsize", parents=[_sizes()], help="the largest model each system trains (bisection)")
    p.add_argument("--systems", default="protrain-chunks,fsdp2-offload", help=f"from {list(SYSTEMS)}")
    p.add_argument(
        "--ladder",
        default="",
        help="the sizes to bisect over, as comma-separated HIDDENxBLOCKS entries of the default ladder, e.g. "
        "4096x32,4096x40 (default: all of it, 1.9B to 78B)",
    )
    p.add_argument("--out", default="out/maxsize.json", help="where the JSON report goes ('' for none)")
    p.set_defaults(func=maxsize, steps=3, warmup=0)
    p = sub.add_parser("scaling", parents=[_sizes()], help="tokens/s on 1, 2, 4 GPUs (torchrun) and the efficiency")
    p.add_argument("--systems", default="protrain-chunks", help=f"data-parallel ones, from {list(SYSTEMS)}")
    p.add_argument("--gpus", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    p.add_argument("--out", default="out/scaling.json", help="where the JSON report goes ('' for none)")
    p.set_defaults(func=scaling)
    p = sub.add_parser("startup", parents=[_sizes()], help="time to the first step, cold and relaunched, per system")
    p.add_argument("--systems", default="compile,protrain-chunks", help=f"comma-separated, from {list(SYSTEMS)}")
    p.add_argument("--measure-hardware", action="store_true", help="the cold run measures the hardware profile too")
    p.add_argument("--out", default="out/startup.json", help="where the JSON report goes ('' for none)")
    p.set_defaults(func=lambda args: _lazy("startup", "startup")(args))
    p = sub.add_parser("plot", help="tokens/s against model size per system, from compare reports (PNG)")
    p.add_argument("reports", nargs="+", help="JSON reports of `compare`, one model size each")
    p.add_argument("--out", default="out/throughput.png", help="the PNG to write")
    p.set_defaults(func=plot)
    p = sub.add_parser("trainer", parents=[_sizes()], help="tokens/s of transformers' Trainer, protrain vs compile")
    p.add_argument("--systems", default="protrain,compile", help=f"comma-separated, from {list(TRAINER_SYSTEMS)}")
    p.add_argument("--system", default="", help=argparse.SUPPRESS)  # (one system's run, in its own process)
    p.add_argument("--output-dir", default="out/trainer", help="the Trainer's output_dir (nothing is saved)")
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="the Trainer's max_grad_norm (its default, 1.0; 0: no clipping)",
    )
    p.set_defaults(func=trainer)
    p = sub.add_parser("worker", parents=[_sizes()], help="one system's run (started by compare)")
    p.add_argument("--system", choices=list(SYSTEMS), required=True)
    p.set_defaults(func=worker)
    return parser
