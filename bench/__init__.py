"""Benchmark harness for protrain_fx: `python -m bench compare` trains one model with several systems.

    python -m bench compare --out out/compare.json              # 1B LLaMA, bf16: protrain, compile, eager
    python -m bench compare --hidden 64 --layers 2 --intermediate 128 --heads 4 --vocab 256 \
        --seq 64 --batch 2 --steps 3 --warmup 1 --dtype float32  # a tiny run, fine on CPU

Each system trains in its own subprocess (`python -m bench worker ...`), so memory peaks don't mix.
model.py builds the model and batches, worker.py runs the training loop, cli.py parses flags and
prints the table. Results are recorded in docs/benchmarks.md.
"""
