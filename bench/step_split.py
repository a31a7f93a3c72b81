"""Split training steps of protrain's chunked training into forward, backward, optimizer step and zero_grad.

    python -m bench.step_split --plan '{"n_persist": 0, "n_buffer": 3}' [--preset 5.5b] [--profile] [--trace PATH]
                               [--loop]

The model is `bench.model`'s LLaMA-style model (`--preset`: 1b, the default, or 5.5b; bf16, batch 8, sequence
1024), trained with `protrain_fx.optim.AdamW`. Each phase is timed between device synchronizations; `--profile`
adds a `torch.profiler` table of two more steps, sorted by CPU time; `--trace` profiles two more steps into a
chrome trace at PATH and prints how much of the copies and of the host AdamW overlaps GPU kernels, and per phase
how long the GPU idled and the rates the copies reached beside each other and the host AdamW (`bench.trace`).
Under `torchrun --nproc_per_node=N -m bench.step_split ...` every rank trains its own batch in one NCCL process
group (the plan's chunks sharded across ranks, as `bench scaling` runs protrain); rank 0 prints and traces.
`--loop` runs the phases back to back as a training loop does, synchronized once per step at its end (as `bench`'s
worker times steps): the phases stay annotated for --trace, but only the whole step is timed, and --trace adds how
long the GPU idled before each step's first kernel (`bench.trace.step_lead_in`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

import protrain_fx
from bench.model import FAMILIES, PRESETS, build_model, preset
from bench.trace import format_phases, format_report, load_events, overlap_report, phase_report, step_lead_in
from bench.worker import _process_group

PHASES = ("bench.forward", "bench.backward", "bench.opt_step", "bench.zero_grad")  # annotated for --trace


def _synced_clock() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.step_split", description=__doc__)
    parser.add_argument("--plan", default="{}", help="JSON plan fields forced on the protrain backend")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--preset", choices=list(PRESETS), default="1b", help="model sizes (default 1b)")
    parser.add_argument("--family", choices=FAMILIES, default="llama", help="architecture (default llama)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--trace", metavar="PATH", help="chrome trace of two more steps, written here and analysed")
    parser.add_argument("--loop", action="store_true", help="synchronize once per step, not between phases")
    parser.add_argument(
        "--trace-match", default="protrain::cpu_adamw", help="CPU events of --trace's analysis (name substring)"
    )
    args = parser.parse_args()
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1  # (torchrun's ranks, each on its own GPU)
    with _process_group(torch.device("cuda")) if several else contextlib.nullcontext():
        _run(args)


def _run(args: argparse.Namespace) -> None:
    lead = not dist.is_initialized() or dist.get_rank() == 0  # (the rank that prints and traces)
    spec = preset(args.preset, args.family)
    model = build_model(spec, torch.device("cuda"), torch.bfloat16, 0)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, backend="protrain", options={"plan": json.loads(args.plan)})
    ids = torch.randint(0, spec.vocab, (args.batch, spec.seq), device="cuda")

    def step() -> list[float]:
        """Milliseconds of forward, backward, opt.step() and zero_grad(), each between synchronizations; with
        --loop, of the whole step."""
        marks, loss = [_synced_clock()], None

        def forward() -> None:
            nonlocal loss
            loss = compiled(input_ids=ids, labels=ids).loss

        for name, phase in zip(PHASES, (forward, lambda: loss.backward(), opt.step, opt.zero_grad)):
            with record_function(name):
                phase()
                if not args.loop:
                    marks.append(_synced_clock())
        if args.loop:
            loss.item()
            marks.append(_synced_clock())
        return [1e3 * (b - a) for a, b in zip(marks, marks[1:])]

    for i in range(args.steps):
        times = step()
        if not lead:
            continue
        if args.loop:
            print(f"step {i}: {times[0]:.1f} ms")
            continue
        fwd, bwd, step_ms, zero = times
        print(
            f"step {i}: forward {fwd:.1f} ms, backward {bwd:.1f} ms, opt.step {step_ms:.1f} ms, zero_grad {zero:.1f} ms"
        )
    if not lead:  # (the other ranks run the traced steps too: the collectives need them)
        for _ in range(2 * (bool(args.profile) + bool(args.trace))):
            step()
        return
    if args.profile:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            step()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    if args.trace:
        # every thread: the chunks' AdamW runs on a worker thread started before the profiler (torch >= 2.11 has this)
        every_thread = _ExperimentalConfig(profile_all_threads=True)
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], experimental_config=every_thread
        ) as prof:
            step()
            step()
        prof.export_chrome_trace(args.trace)
        print(f"trace of two steps: {args.trace}")
        events = load_events(args.trace)
        print(format_report(overlap_report(events, args.trace_match)))
        print(format_phases(phase_report(events, list(PHASES), args.trace_match)))
        if args.loop:  # (the phases' GPU work runs past their CPU spans: the idle time between steps is the lead-in)
            lead_in = step_lead_in(events, PHASES[0])
            print("GPU idle before each step's first kernel: " + ", ".join(f"{us / 1e3:.2f} ms" for us in lead_in))


if __name__ == "__main__":
    main()
