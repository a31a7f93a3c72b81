"""Train a small LLaMA-style model through the `protrain` torch.compile backend, on random tokens.

    python examples/train_llama.py                       # inductor executor; CUDA (bf16 autocast) if present, else CPU (fp32)
    python examples/train_llama.py --executor eager      # run the FX graphs directly (debugging)
    PROTRAIN_DUMP_DIR=dumps python examples/train_llama.py --steps 2   # also write graphs, profile, plan

The model is built from a transformers `LlamaConfig` (no downloads). The backend is passed as an object,
`protrain_fx.ProTrainBackend(options)`, so that the plan of each compiled graph can be read from
`backend.graphs` after the first step. `backend="protrain"` with `options={...}` trains the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import protrain_fx


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--batch", type=int, default=4, help="batch size")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument(
        "--data-batches",
        type=int,
        default=1,
        help="distinct random batches, cycled (1: the model memorizes one batch, so the loss visibly falls)",
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    p.add_argument("--executor", choices=["inductor", "eager"], default="inductor")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        use_cache=False,
    )
    model = LlamaForCausalLM(config).to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    backend = protrain_fx.ProTrainBackend({"executor": args.executor})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    # bf16 autocast on a GPU; plain fp32 on CPU
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    print(
        f"LLaMA: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {n_params / 1e6:.2f}M parameters; "
        f"batch {args.batch} x seq {args.seq}; device {device}; executor {args.executor}"
    )
    gen = torch.Generator().manual_seed(args.seed)  # random tokens, the same every run
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen) for _ in range(args.data_batches)]
    tokens_per_step = args.batch * args.seq
    timed_tokens, timed_s = 0, 0.0
    for step in range(1, args.steps + 1):
        ids = data[(step - 1) % len(data)].to(device)
        start = time.perf_counter()
        with autocast:
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # synchronizes, so the step time below is complete
        elapsed = time.perf_counter() - start

        if step == 1:  # the first step compiled, profiled and planned every graph
            print(f"step 1 (compile + profile + plan) took {elapsed:.1f} s; {len(backend.graphs)} graph(s)")
            for g in backend.graphs:
                where = g.block_map.describe() if g.block_map else "no blocks"
                print(f"graph {g.index}: {len(g.param_map)} parameters, {where}")
                if g.profile is not None:
                    pr = g.profile
                    print(
                        f"  profile: forward {pr.forward_s * 1e3:.1f} ms, backward {pr.backward_s * 1e3:.1f} ms, "
                        f"peak {pr.peak_bytes / 2**20:.1f} MiB, saved activations {pr.saved_bytes / 2**20:.1f} MiB"
                    )
                print("  plan in force:" if g.plan is not None else "  no plan (compiled without autograd)")
                if g.plan is not None:
                    print("\n".join("    " + line for line in str(g.plan).splitlines()))
        else:
            timed_tokens += tokens_per_step
            timed_s += elapsed
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            print(f"step {step:4d}  loss {loss_value:.4f}  {tokens_per_step / elapsed:,.0f} tokens/s")

    if timed_s > 0:
        print(f"steps 2-{args.steps}: {timed_tokens / timed_s:,.0f} tokens/s on {device}")


if __name__ == "__main__":
    main()
