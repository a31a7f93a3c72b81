"""Chunked training across ranks (gloo, spawned processes): every rank ends with eager training's parameters.

Each rank trains on the same batches. With 2 ranks the averaged gradient (g + g) / 2 equals g exactly, so the
result must be bitwise equal to single-process eager training with `torch.optim.AdamW(fused=True)`. With 3,
(g + g + g) / 3 rounds: losses agree to 1e-5, parameters to steps * lr (AdamW normalizes each update to about
lr, so a rounding difference in a near-zero gradient can move a parameter by that much).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, kind: str, plan: dict, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from test_chunk_parity import run

        import protrain_fx

        exact = world & (world - 1) == 0  # a power of two averages without rounding
        ref, model, _ = run(kind, plan, steps=4, exact=exact)
        state = protrain_fx.full_state_dict(model)  # a collective: every rank calls it
        for name, value in ref.state_dict().items():
            if exact:
                assert torch.equal(state[name], value), f"rank {rank}: {name} differs"
            else:
                torch.testing.assert_close(state[name], value, rtol=0, atol=4 * 1e-2)
    except BaseException as e:  # report to the parent, which fails the test
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "kind, plan", [("toy", {"n_persist": 0, "n_buffer": 3}), ("llama", {"n_persist": 1, "n_buffer": 1})]
)
def test_ranks_train_like_eager(world, kind, plan):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, kind, plan, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not messages, messages
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
