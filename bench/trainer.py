"""`python -m bench trainer`: tokens/s of Hugging Face's `Trainer` training the bench model, with the model
compiled by protrain (its AdamW, the plan searched or forced by --plan) or by plain `torch.compile` (torch's fused
AdamW), each system in its own process, with the Trainer's defaults on (clipping at 1.0 unless --max-grad-norm says
otherwise, a linear schedule)."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time

import torch

from bench.model import DTYPES, ModelSpec, build_prepared_model, random_batches, resolve_init

log = logging.getLogger(__name__)

TRAINER_SYSTEMS = ("protrain", "compile")
RESULT_PREFIX = "TRAINER_RESULT "
LR = 1e-4


def trainer(args: argparse.Namespace) -> int:
    """Each of --systems in its own process (`--system` set: this process runs that one)."""
    if args.clip:
        raise SystemExit("the Trainer clips by --max-grad-norm, not --clip")
    if args.system:
        print(RESULT_PREFIX + json.dumps(_run(args.system, args)), flush=True)
        return 0
    rows = []
    for system in [s.strip() for s in args.systems.split(",") if s.strip()]:
        if system not in TRAINER_SYSTEMS:
            raise SystemExit(f"unknown system {system!r}; choose from {list(TRAINER_SYSTEMS)}")
        command = [sys.executable, "-m", "bench", *sys.argv[1:], "--system", system]
        out = subprocess.run(command, capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
        if line is None:
            log.error("%s failed:\n%s", system, out.stderr[-4000:])
            rows.append({"system": system, "error": out.stderr[-400:]})
            continue
        rows.append(json.loads(line[len(RESULT_PREFIX) :]))
    for row in rows:
        print(json.dumps(row))
    return 1 if any("error" in r for r in rows) else 0


class _StepTimer:
    """A TrainerCallback: the wall time of each optimizer step (the device synchronised at both ends)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.times.append(time.perf_counter() - self._start)

    def __getattr__(self, name):  # every other TrainerCallback event: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _run(system: str, args: argparse.Namespace) -> dict:
    from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

    import protrain_fx

    spec = ModelSpec.from_args(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.gpu_memory_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.gpu_memory_gib * 2**30 / total, 0)
    if args.init not in ("gpu", "auto") and system != "protrain":
        raise ValueError(f"--init {args.init!r} is for protrain only")
    limit = int(args.gpu_memory_gib * 2**30)
    init = resolve_init(args.init, system == "protrain", spec, DTYPES[args.dtype], device, limit)
    model = build_prepared_model(spec, device, DTYPES[args.dtype], args.seed, init)
    steps = args.warmup + args.steps
    if system == "protrain":
        options = {"plan": json.loads(args.plan), "executor": args.executor, "replan": args.replan}
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=LR)
        model.compile(backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        model.compile(dynamic=False)
    batches = random_batches(spec, 1, args.batch * steps, torch.device("cpu"), args.seed)
    data = [{"input_ids": b[0], "labels": b[0]} for b in batches]
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=args.seed,
        max_grad_norm=args.max_grad_norm,
        use_cpu=device.type == "cpu",
    )
    timer = _StepTimer()
    schedule = get_linear_schedule_with_warmup(opt, 2, steps)
    Trainer(model=model, args=training, train_dataset=data, optimizers=(opt, schedule), callbacks=[timer]).train()
    measured = timer.times[args.warmup :]
    step_s = sum(measured) / len(measured)
    plan = protrain_fx.plan_of(model).to_json() if system == "protrain" else {}
    return {
        "system": system,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "step_s": step_s,
        "tokens_per_s": args.batch * spec.seq / step_s,
        "step_times_s": [round(t, 4) for t in timer.times],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "plan": {k: v for k, v in plan.items() if k.startswith("n_") or k == "block_modes"},
    }
