"""A plain accelerate loop over a model compiled by protrain with `protrain_fx.optim.AdamW`, against the same loop
over the eager model with torch's fused AdamW: `accelerator.prepare` wraps the optimizer (`AcceleratedOptimizer`,
which loads its own state dict back into it) and the scheduler (`AcceleratedScheduler`); `accumulate` skips the
optimizer's step and zero_grad on the first of two micro-batches, `backward` divides the loss by two, and
`clip_grad_norm_` clips `.grad` through torch's clip_grad_norm_, at every micro-batch or only where gradients are
complete (`sync_gradients`). With several processes `prepare` wraps the model in DistributedDataParallel, which
passes it through (`accumulate`'s `no_sync` is protrain's), or the model stays out of `prepare`; either way the
chunks reduce its gradients across ranks.

Tolerance: bitwise, as the Trainer's (tests/test_trainer.py): fp32 on the CPU, protrain's eager executor. Two
ranks see the same batches, so their averaged gradient is each one's, exactly.
"""

from __future__ import annotations

import os

import models
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from helpers import ALL_OFFLOADED
from spawn import spawn_gloo
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

import protrain_fx

KIND = "llama"
PLANS = {"persistent": {}, "offloaded": ALL_OFFLOADED}
SAMPLES = [{k: v[0] for k, v in models.batch(KIND, batch_size=1, seed=i).items()} for i in range(16)]


def _accelerator() -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)  # (a fresh Accelerator per run, as in a new process)
    GradientState._reset_state()
    return Accelerator(gradient_accumulation_steps=2, cpu=True)


def _build(options: dict | None, layers: int = 2):
    """The model (of `layers` blocks), its optimizer (torch's fused AdamW when `options` is None, else protrain's,
    the model compiled with `options`) and a warmup schedule."""
    model = models.build(KIND, layers=layers)
    if options is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    else:
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model.compile(backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    return model, opt, get_linear_schedule_with_warmup(opt, 2, 4)


def _loop(accelerator, model, opt, sched, loader, clip_every_micro_batch: bool) -> tuple[list, list, dict]:
    """The loop of accelerate's documentation (its own: accelerate's loop is what is tested); the losses, the clipped
    norms and the final weights."""
    losses, norms = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if clip_every_micro_batch or accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
    model = accelerator.unwrap_model(model)
    chunked = protrain_fx.manager_of(model) is not None
    return losses, norms, protrain_fx.full_state_dict(model) if chunked else model.state_dict()


def _assert_same(ours: tuple, eager: tuple) -> None:
    assert ours[0] == eager[0] and ours[1] == eager[1]
    assert ours[2].keys() == eager[2].keys()
    for name, value in eager[2].items():
        assert torch.equal(ours[2][name], value), name


@pytest.mark.parametrize(
    "plan, clip_every_micro_batch", [("offloaded", True), ("offloaded", False), ("persistent", True)]
)
def test_accelerate_loop_like_eager(plan, clip_every_micro_batch):
    runs = []
    for options in (None, {"executor": "eager", "plan": PLANS[plan]}):
        accelerator = _accelerator()
        model, opt, sched, loader = accelerator.prepare(*_build(options), DataLoader(SAMPLES, batch_size=2))
        runs.append(_loop(accelerator, model, opt, sched, loader, clip_every_micro_batch))
    eager, ours = runs
    assert len(eager[1]) == (8 if clip_every_micro_batch else 4)
    _assert_same(ours, eager)


def _two_ranks(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # each pair of samples twice: the prepared loader gives both ranks the same batches
    samples = [s for i in range(0, len(SAMPLES), 2) for s in SAMPLES[i : i + 2] * world]

    def run(options: dict | None, model_in_prepare: bool) -> tuple:
        accelerator = _accelerator()
        model, opt, sched = _build(options, layers=1)  # (one block: each rank compiles twice)
        loader = DataLoader(samples, batch_size=2)
        if model_in_prepare:  # (DistributedDataParallel around the model)
            model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
            assert isinstance(model, DistributedDataParallel)
        else:
            opt, loader, sched = accelerator.prepare(opt, loader, sched)
        return _loop(accelerator, model, opt, sched, loader, False)

    eager = run(None, True)
    for model_in_prepare in (True, False):
        _assert_same(run({"executor": "eager", "plan": PLANS["offloaded"]}, model_in_prepare), eager)

    model = models.build(KIND, layers=1)
    outside = list(model.parameters())[-1]  # (trained by another optimizer)
    _opt = protrain_fx.optim.AdamW([p for p in model.parameters() if p is not outside])  # (kept: it marks them)
    model.compile(backend=protrain_fx.ProTrainBackend({"executor": "eager"}), dynamic=False)
    with pytest.raises(Exception, match="no protrain_fx.optim.AdamW steps"):
        DistributedDataParallel(model)(**models.batch(KIND))
    prepared = protrain_fx.prepare(models.build(KIND, layers=1), plan=PLANS["offloaded"], device="cpu")
    with pytest.raises(RuntimeError, match="DistributedDataParallel is not needed"):  # (not a crash)
        DistributedDataParallel(prepared)


def test_several_processes():
    """Two gloo ranks: the accelerate loop over the model given to `prepare` (DistributedDataParallel, which
    passes it through) and over the model left out of `prepare`, its chunks offloaded (sharded across the ranks),
    trains as eager DDP does. DDP around a model with a trainable parameter outside the chunks is
    an error that says what to do, and DDP over a model whose chunks are built ignores the chunked parameters
    (reading an offloaded one would crash the process)."""
    spawn_gloo(_two_ranks, 2)
