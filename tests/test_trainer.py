"""Hugging Face `Trainer` with a model compiled in place by protrain and `protrain_fx.optim.AdamW`, against the same
Trainer training the eager model with torch's fused AdamW: the Trainer's defaults (gradient clipping at 1.0, its
norm logged), a linear warmup schedule, two micro-batches per step (accumulated without `no_sync`; with two
processes, under DDP's), a checkpoint saved mid-run (safetensors weights, `optimizer.pt`) and resumed, and
`evaluate()`; in one process, and in two (gloo), where both runs are under the Trainer's DistributedDataParallel.

Tolerance: bitwise. On the CPU in fp32, protrain's eager executor reads the same values as eager PyTorch and its
update is the same fused kernel on views of the chunks, so logged losses and gradient norms, the eval loss, the
saved checkpoint and the final weights are equal, and so are those of the run resumed from the checkpoint. Two
ranks see the same batches, so their averaged gradient, (g + g) / 2, is each one's exactly.
"""

from __future__ import annotations

import functools
import os

import models
import pytest
import torch
from helpers import ALL_OFFLOADED
from safetensors.torch import load_file
from spawn import spawn_gloo
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

import protrain_fx

STEPS, SAVE_AT = 4, 2
PLANS = {"persistent": {}, "offloaded": ALL_OFFLOADED}
SIZES = {"t5": {"layers": 1}}  # (one block in each stack: its three-named embedding as with more, compiled sooner)


class _Batches(Dataset):
    """Fixed samples of `kind`'s batches."""

    def __init__(self, kind: str, n: int, seed: int = 0):
        self.items = [models.batch(kind, batch_size=1, seed=seed + i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.items[i].items()}


class _Twice(Dataset):
    """Each pair of `samples` `world` times over: a sequential sampler gives every rank the same batches of 2."""

    def __init__(self, samples: Dataset, world: int):
        self.items = [samples[j] for i in range(0, len(samples), 2) for j in [i, i + 1] * world]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def _train(kind: str, out: str, options: dict | None = None, resume: str | None = None, world: int = 1) -> dict:
    """Train `kind` with the Trainer (eagerly with torch's fused AdamW when `options` is None); what it logged and
    saved, the final weights and, unless resumed, the eval loss. A resumed model starts from other weights, which
    the checkpoint's replace. With several ranks, each trains on the same batches."""
    model = models.build(kind, seed=0 if resume is None else 1, **SIZES.get(kind, {}))
    several = {"train_sampling_strategy": "sequential"} if world > 1 else {}
    args = TrainingArguments(
        **several,
        output_dir=out,
        max_steps=STEPS,
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        save_steps=SAVE_AT,
        logging_steps=1,
        per_device_eval_batch_size=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    # as the README shows it (the backend's options aside)
    if options is None:
        opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    else:
        model.compile(backend=protrain_fx.ProTrainBackend(options), dynamic=False)
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    sched = get_linear_schedule_with_warmup(opt, args.warmup_steps, args.max_steps)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_Twice(_Batches(kind, 16), world) if world > 1 else _Batches(kind, 16),
        eval_dataset=_Batches(kind, 2, seed=100),
        optimizers=(opt, sched),
    )
    trainer.train(resume_from_checkpoint=resume)
    checkpoint = f"{out}/checkpoint-{SAVE_AT}"
    return {
        "logs": [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e],
        "weights": protrain_fx.full_state_dict(model) if options is not None else model.state_dict(),
        "saved": load_file(f"{checkpoint}/model.safetensors"),
        "saved_optimizer": torch.load(f"{checkpoint}/optimizer.pt"),
        "eval_loss": trainer.evaluate()["eval_loss"] if resume is None else None,
        "in_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "manager": protrain_fx.manager_of(model),
    }


@functools.cache
def _eager(kind: str, tmp: str) -> dict:
    return _train(kind, f"{tmp}/eager-{kind}")


def _assert_equal_states(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


@pytest.mark.parametrize(
    "kind, plan, resume",
    [
        ("llama", "offloaded", True),
        ("llama", "persistent", False),
        ("gpt2", "offloaded", True),
        ("t5", "offloaded", True),
    ],
)
def test_trainer_like_eager(kind, plan, resume, tmp_path_factory):
    """Logged losses and clipped gradient norms, the eval loss, the checkpoint (weights and optimizer states) and
    the final weights are eager training's; a run resumed from the checkpoint (its weights, optimizer states,
    schedule and data order) logs and ends as the uninterrupted one."""
    eager = _eager(kind, str(tmp_path_factory.getbasetemp()))
    out = str(tmp_path_factory.mktemp(f"{kind}-{plan}"))
    options = {"executor": "eager", "plan": PLANS[plan]}
    ours = _train(kind, out, options)
    _assert_like(ours, eager)
    if not resume:
        return
    resumed = _train(kind, out, options, resume=f"{out}/checkpoint-{SAVE_AT}")
    assert resumed["logs"] == eager["logs"]
    _assert_equal_states(resumed["weights"], eager["weights"])


def _assert_like(ours: dict, eager: dict) -> None:
    assert len(ours["logs"]) == STEPS and ours["logs"] == eager["logs"]
    assert ours["eval_loss"] == eager["eval_loss"]
    _assert_equal_states(ours["saved"], eager["saved"])
    saved, eager_saved = ours["saved_optimizer"], eager["saved_optimizer"]
    assert saved["state"].keys() == eager_saved["state"].keys()
    for i, st in eager_saved["state"].items():
        _assert_equal_states(saved["state"][i], st)
    _assert_equal_states(ours["weights"], eager["weights"])


def _two_ranks(out: str, rank: int, world: int) -> None:
    """The comparison of `test_trainer_like_eager` on each rank, both runs under DistributedDataParallel."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    eager = _train("llama", f"{out}/eager", world=world)
    options = {"executor": "eager", "plan": PLANS["offloaded"]}
    ours = _train("llama", f"{out}/ours", options, world=world)
    assert eager["in_ddp"] and ours["in_ddp"]
    manager = ours["manager"]  # (offloaded chunks whole on each rank, gradients averaged over both)
    assert manager.n_persist == 0 and manager.world_size == 1 and manager.reduce_world == world
    _assert_like(ours, eager)
    resumed = _train("llama", f"{out}/ours", options, resume=f"{out}/ours/checkpoint-{SAVE_AT}", world=world)
    assert resumed["logs"] == eager["logs"]
    _assert_equal_states(resumed["weights"], eager["weights"])


def test_trainer_several_processes(tmp_path):
    """Two gloo ranks, as under torchrun: the Trainer wraps the model in DistributedDataParallel, which passes it
    through (the chunks reduce its gradients, offloaded chunks whole on each rank so that rank 0 saves the
    checkpoint alone); logs, eval loss, checkpoint, final weights and the resumed run are eager DDP's, bitwise."""
    spawn_gloo(functools.partial(_two_ranks, str(tmp_path)), 2)
