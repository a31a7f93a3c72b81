"""The host side of an offloaded chunk, measured alone: the CPU AdamW step, the bf16 publish copy and the
PCIe copies, on the main thread and on a worker thread (as the ChunkManager runs them).

    python -m bench.cpu_adam [--elems 202000000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import torch


def _timed(fn, repeat: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_adam", description=__doc__)
    parser.add_argument("--elems", type=int, default=202_000_000, help="elements of one chunk shard")
    args = parser.parse_args()
    n = args.elems
    master = torch.randn(n)
    master.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([master], lr=1e-4, fused=True)
    bf16 = torch.empty(n, dtype=torch.bfloat16)
    rows = [("torch threads (main)", torch.get_num_threads(), "")]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    rows.append(("torch threads (worker)", pool.submit(torch.get_num_threads).result(), ""))
    adam = _timed(opt.step)
    rows.append(("fused AdamW, main thread", f"{adam * 1e3:.1f} ms", f"{n / adam / 1e9:.2f} Gparam/s"))
    adam_w = _timed(lambda: pool.submit(opt.step).result())
    rows.append(("fused AdamW, worker thread", f"{adam_w * 1e3:.1f} ms", f"{n / adam_w / 1e9:.2f} Gparam/s"))
    publish = _timed(lambda: bf16.copy_(master))
    rows.append(("publish fp32 -> bf16", f"{publish * 1e3:.1f} ms", f"{n / publish / 1e9:.2f} Gparam/s"))
    if torch.cuda.is_available():
        dev32 = torch.empty(n, device="cuda")
        dev16 = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        pinned32 = torch.empty(n).pin_memory()
        pinned16 = torch.empty(n, dtype=torch.bfloat16).pin_memory()
        for name, dst, src in (
            ("H2D bf16", dev16, pinned16),
            ("D2H fp32", pinned32, dev32),
            ("D2H bf16", pinned16, dev16),
        ):

            def copy(dst=dst, src=src):
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()

            t = _timed(copy)
            rows.append((name, f"{t * 1e3:.1f} ms", f"{src.numel() * src.element_size() / t / 1e9:.1f} GB/s"))
    for row in rows:
        print(" | ".join(str(c).ljust(28) for c in row))


if __name__ == "__main__":
    main()
