"""Split training steps of protrain's chunked training into forward, backward, optimizer step and zero_grad.

    python -m bench.step_split --plan '{"n_persist": 0, "n_buffer": 3}' [--profile]

The model is `bench.model`'s default LLaMA-style model (about 1B parameters, bf16, batch 8, sequence 1024),
trained with `protrain_fx.optim.AdamW`. Each phase is timed between device synchronizations; `--profile`
adds a `torch.profiler` table of two more steps, sorted by CPU time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import protrain_fx
from bench.model import ModelSpec, build_model


def _synced_clock() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.step_split", description=__doc__)
    parser.add_argument("--plan", default="{}", help="JSON plan fields forced on the protrain backend")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    spec = ModelSpec()
    model = build_model(spec, torch.device("cuda"), torch.bfloat16, 0)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, backend="protrain", options={"plan": json.loads(args.plan)})
    ids = torch.randint(0, spec.vocab, (args.batch, spec.seq), device="cuda")

    def step() -> list[float]:
        """Milliseconds of forward, backward, opt.step() and zero_grad(), each between synchronizations."""
        marks = [_synced_clock()]
        loss = compiled(input_ids=ids, labels=ids).loss
        marks.append(_synced_clock())
        loss.backward()
        marks.append(_synced_clock())
        opt.step()
        marks.append(_synced_clock())
        opt.zero_grad()
        marks.append(_synced_clock())
        return [1e3 * (b - a) for a, b in zip(marks, marks[1:])]

    for i in range(args.steps):
        fwd, bwd, step_ms, zero = step()
        print(
            f"step {i}: forward {fwd:.1f} ms, backward {bwd:.1f} ms, opt.step {step_ms:.1f} ms, zero_grad {zero:.1f} ms"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            step()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
