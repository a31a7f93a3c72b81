"""The training loop's last corners (issue 66): a plan with more chunk buffers than chunks, `chunk_bytes: 0`, a
weight tied after the chunks were built, a second protrain_fx.optim.AdamW while the first is still held, and the
Hugging Face Trainer left to build its own optimizer. Each either trains as eager PyTorch does or raises (or logs
once) an error that names what is wrong and says what to do.

Tolerance: bitwise, where training goes on after an error: on the CPU in fp32, protrain's eager executor reads the
same values as eager PyTorch and steps with the same fused AdamW kernel (tests/test_training_loop_contract.py).
"""

from __future__ import annotations

import copy
import logging
import re

import models
import pytest
import torch
from helpers import train
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

import protrain_fx
from protrain_fx.planner.plan import LEAST_BUFFERS_RECOMPUTING, make_plan

EAGER = {"executor": "eager"}


def _compiled(model, options=None):
    return torch.compile(model, backend=protrain_fx.ProTrainBackend({**EAGER, **(options or {})}), dynamic=False)


# -- a plan's n_buffer against the chunk count; chunk_bytes 0


def test_more_buffers_than_chunks_are_refused_by_prepare():
    """The tiny LLaMA lays out in 2 chunks: 3 buffers are the most (the search's own least, which it gives a model of
    fewer chunks, so a searched plan replayed is accepted), 10 an error that says so."""
    model = models.build("llama")
    with pytest.raises(
        ValueError, match=r"\['n_buffer'\]=10 is more chunk buffers than this model's 2 chunks .* at most 3"
    ):
        protrain_fx.prepare(model, plan={"n_buffer": 10})
    layout = protrain_fx.manager_of(protrain_fx.prepare(models.build("llama"), plan={"n_persist": 0})).layout
    assert layout.n_chunk == 2
    assert make_plan(2, {"n_persist": 0, "n_buffer": LEAST_BUFFERS_RECOMPUTING}, layout).n_buffer == 3


def test_more_buffers_than_chunks_are_refused_by_the_compile():
    """The toy lays out in 11 chunks: `options={"plan": {"n_buffer": 40}}` was accepted silently."""
    model = models.build("toy")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = _compiled(model, {"plan": {"n_buffer": 40}})
    with pytest.raises(
        Exception, match=r"\['n_buffer'\]=40 is more chunk buffers than this model's 11 chunks .* at most 11"
    ):
        train(compiled, "toy", 1, opt=opt)


def test_chunk_bytes_zero_is_the_size_the_layout_chooses():
    """A prepared model's chunks have the size the layout chose; `chunk_bytes: 0` in the compile's plan asks for just
    that (it clashed with the built chunks before)."""
    ref = models.build("toy")
    model = protrain_fx.prepare(copy.deepcopy(ref), plan={"n_persist": 0, "n_buffer": 3}, device="cpu")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    expected = train(ref, "toy", 2, opt=torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True))
    assert train(_compiled(model, {"plan": {"chunk_bytes": 0}}), "toy", 2, opt=opt) == expected
    assert protrain_fx.plan_of(model).chunk_bytes == protrain_fx.manager_of(model).layout.chunk_bytes > 0


# -- weights tied after the chunks were built

TIED = r"'lm_head.weight' was tied to 'model.embed_tokens.weight' .* before protrain_fx.prepare"


def _tie(model) -> None:
    model.lm_head.weight = model.model.embed_tokens.weight


def test_tying_after_prepare_is_refused_when_the_optimizer_is_built():
    """It was accepted, and the first `opt.step()` raised a bare KeyError (the head's chunk held a parameter the
    model no longer has)."""
    model = protrain_fx.prepare(models.build("llama"), plan={"n_persist": 2}, device="cpu")
    _tie(model)
    with pytest.raises(ValueError, match=TIED):
        protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("when", ["before-the-first-step", "after-a-step"])
def test_tying_after_the_chunks_are_built_is_refused_at_the_next_step(when):
    """Prepared, the optimizer built, then tied: the first compile refuses it (it trained, but the chunks' hooks
    still took the head's entry of a `load_state_dict` into the parameter the model no longer has). Chunks built by
    the first step, then tied: the next call refuses it (it said "created or replaced" before, not "tied")."""
    model = models.build("llama")
    if when == "before-the-first-step":
        protrain_fx.prepare(model, plan={"n_persist": 2}, device="cpu")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = _compiled(model)
    if when == "after-a-step":
        train(compiled, "llama", 1, opt=opt)
    _tie(model)
    with pytest.raises(Exception, match=TIED):  # (a compile's error comes wrapped in Dynamo's)
        train(compiled, "llama", 1, opt=opt, first_step=1)


# -- a second optimizer while the first is still held


def test_a_second_optimizer_names_the_parameter_and_training_goes_on():
    """The first optimizer is held by its lr scheduler: the error names the parameter and the cause, and leaves
    every parameter with the first, which steps on as eager's does; dropped with its scheduler, a new one takes
    over (fresh AdamW states, as torch's)."""
    ref = models.build("llama")
    model = copy.deepcopy(ref)
    compiled = _compiled(model, {"plan": {"n_persist": 0, "n_buffer": 2}})

    def first(m, adamw):
        opt = adamw(m.parameters(), lr=1e-2)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    ref_opt, ref_sched = first(ref, lambda ps, lr: torch.optim.AdamW(ps, lr=lr, fused=True))
    opt, sched = first(model, protrain_fx.optim.AdamW)
    expected = train(ref, "llama", 2, opt=ref_opt, after_step=_stepping(ref_sched))
    losses = train(compiled, "llama", 1, opt=opt, after_step=_stepping(sched))
    del opt
    with pytest.raises(ValueError, match=r"parameter 'model.embed_tokens.weight' is stepped by another .* scheduler"):
        protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    losses += train(compiled, "llama", 1, opt=sched.optimizer, first_step=1, after_step=_stepping(sched))
    del sched, ref_opt, ref_sched
    expected += train(ref, "llama", 2, opt=torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True), first_step=2)
    losses += train(compiled, "llama", 2, opt=protrain_fx.optim.AdamW(model.parameters(), lr=1e-3), first_step=2)
    assert losses == expected


def test_an_optimizer_dropped_while_its_host_updates_run_makes_way_for_a_new_one(monkeypatch):
    """`opt.step()` returns while the offloaded chunks' host updates still run, and each update holds its optimizer
    until it ends: a new optimizer built at once, the old one dropped, waits for them instead of finding the old one
    alive (the error of the test above, which a loaded machine gave that test at random). Here every host update
    takes a while."""
    import time

    from protrain_fx import host_queue

    execute = host_queue._execute
    monkeypatch.setattr(host_queue, "_execute", lambda copied, fn: (time.sleep(0.5), execute(copied, fn))[1])
    ref = models.build("llama")
    model = copy.deepcopy(ref)
    compiled = _compiled(model, {"plan": {"n_persist": 0, "n_buffer": 2}})
    expected = train(ref, "llama", 1, opt=torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True))
    losses = train(compiled, "llama", 1, opt=protrain_fx.optim.AdamW(model.parameters(), lr=1e-2))
    expected += train(ref, "llama", 1, opt=torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True), first_step=1)
    losses += train(compiled, "llama", 1, opt=protrain_fx.optim.AdamW(model.parameters(), lr=1e-3), first_step=1)
    assert losses == expected


def _stepping(scheduler):
    return lambda step: scheduler.step()


# -- a step changed after its backward, at a later step only: skipped, clipped first, or its lr set

# offloaded: the last chunk updates during the backward of a step after one that changed nothing, keeping what it
# changes to undo it where the step is changed after all (`speculates`)
PLANS = {"persistent": {}, "offloaded": {"n_persist": 0, "n_buffer": 2, "n_clip_overlap": 1}}
LATER = 2  # the step the loop first changes after its backward (updates ran during the backwards from step 1 on)


def _changed_later(corner: str, model, opt, step: int) -> str | None:
    """Protrain's loop between backward() and the next forward at `step`: at `LATER` (and after, as `corner` says) it
    skips the step (`zero_grad()`, no `step()`), clips, or sets the lr. An error is caught where it is raised, and
    the loop goes on as written; returns its message."""
    try:
        if corner.startswith("skip") and step in (LATER, LATER + 1):
            _SKIPS[corner](model, opt)  # (a loss spike: no step)
            return None
        if corner == "clip" and step >= LATER:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        if corner == "lr" and step == LATER:
            opt.param_groups[0]["lr"] = 1e-3
        try:
            opt.step()
        finally:
            opt.zero_grad()
    except RuntimeError as e:
        if corner == "clip":  # (the clip raised: the step goes on)
            opt.step()
            opt.zero_grad()
        return str(e)
    return None


_SKIPS = {  # how a loop drops a step's gradients
    "skip": lambda model, opt: opt.zero_grad(),
    "skip-model": lambda model, opt: model.zero_grad(),
    "skip-zeros": lambda model, opt: opt.zero_grad(set_to_none=False),
    "skip-said": lambda model, opt: opt.zero_grad(),
}


def _as_told(corner: str, model, opt, step: int) -> None:
    """Eager PyTorch's loop taking the steps as protrain's error says it took them: the step skipped at `LATER`
    applied, the clip refused there not made, the lr set there applying from the next step on."""
    if (corner.startswith("skip") and step == LATER + 1) or (corner == "skip-said" and step == LATER):
        opt.zero_grad()
        return
    if corner == "clip" and step > LATER:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    opt.step()
    opt.zero_grad()
    if corner == "lr" and step == LATER:
        opt.param_groups[0]["lr"] = 1e-3


def _assert_told(corner: str, message: str) -> None:
    """The error says how the step was affected and how a loop has the change apply from the first."""
    said = {
        "skip-model": r"the .grad of 'model.embed_tokens.weight' set to None before optimizer.step\(\) \(skipping",
        "skip-zeros": r"zero_\(\) on the gradient of .* before optimizer.step\(\) \(skipping",
        "skip": r"before optimizer.step\(\) \(skipping the step\?\).* this step was applied whole, as optimizer.step\(\)",
        "clip": r"aten::mul_ on the gradient of .*: refused, so this step's optimizer update stays as the backward "
        r"left the gradients",
        "lr": r"lr 0.01 -> 0.001\) were not applied to this step.* applied whole with the values of the backward",
    }[corner]
    assert re.search(said, message, re.S), message
    assert "From the next step on updates wait for optimizer.step()" in message, message
    assert "protrain_fx.optim.AdamW(..., edits_after_backward=True)" in message, message


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("corner", ["skip", "skip-model", "skip-zeros", "clip", "lr", "skip-said"])
def test_a_step_changed_after_its_backward_at_a_later_step(corner, plan):
    """From the second step on, chunks update during the backward. A step skipped there (`zero_grad()` of the
    optimizer or the model, or `zero_grad(set_to_none=False)`; no `step()`), clipped there for the first time, or whose lr is set there, was an error after which the run could
    not go on (the next backward: "got a gradient after its optimizer step had started"). Now the error says how
    that step was taken (a skipped one applied whole; a clip refused; an lr kept for the step), training goes on,
    and later steps change exactly: losses and weights are those of eager PyTorch taking that step as told.
    "skip-said": an optimizer built with `edits_after_backward=True` skips every step exactly, with no error."""
    ref = models.build("llama")
    model = copy.deepcopy(ref)
    compiled = _compiled(model, {"plan": PLANS[plan]})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, edits_after_backward=corner == "skip-said")
    runs, told = [], {}
    for net, o, m, eager in ((ref, ref_opt, ref, True), (compiled, opt, model, False)):
        runs.append([])
        for step in range(LATER + 3):
            loss = models.loss_of("llama", net(**models.batch("llama", seed=step)))
            loss.backward()
            if eager:
                _as_told(corner, m, o, step)
            elif (message := _changed_later(corner, m, o, step)) is not None:
                told[step] = message
            runs[-1].append(loss.item())
    assert list(told) == ([] if corner == "skip-said" else [LATER]), told
    for message in told.values():
        _assert_told(corner, message)
    assert runs[1] == runs[0]
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name


# -- torch.autograd.grad over the parameters


@pytest.mark.parametrize("plan", PLANS)
def test_autograd_grad_of_the_parameters(plan):
    """`torch.autograd.grad(loss, list(model.parameters()))` gives eager's gradients, bitwise, at the first step
    and after steps, and leaves `.grad`, the weights and the optimizer alone: training goes on as eager's. (It
    raised "appears to not have been used in the graph", or with offloaded chunks "modified by an inplace
    operation".) An unused parameter is told as torch tells it, or given None or zeros as asked."""
    unused = lambda m: m.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))  # noqa: E731
    ref = models.build("llama")
    unused(ref)
    model = copy.deepcopy(ref)
    compiled = _compiled(model, {"plan": PLANS[plan]})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)

    def grads(net, m, seed, **kw):
        return torch.autograd.grad(models.loss_of("llama", net(**models.batch("llama", seed=seed))), m, **kw)

    def used(m):
        return [p for p in m.parameters() if p is not m.unused]

    for step in range(3):
        got = grads(compiled, used(model), seed=10 + step)
        expected = grads(ref, used(ref), seed=10 + step)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert all(p.grad is None for p in model.parameters())
        assert train(compiled, "llama", 1, opt=opt, first_step=step) == train(
            ref, "llama", 1, opt=ref_opt, first_step=step
        )
    state = protrain_fx.full_state_dict(model)
    assert all(torch.equal(state[name], value) for name, value in ref.state_dict().items())
    with pytest.raises(RuntimeError, match="index 1 appears to not have been used in the graph"):
        grads(compiled, [model.model.norm.weight, model.unused], seed=0)
    assert grads(compiled, [model.unused], seed=0, allow_unused=True) == (None,)
    assert torch.equal(grads(compiled, [model.unused], seed=0, materialize_grads=True)[0], torch.zeros(3))


# -- the Trainer's own optimizer


class _Batches(Dataset):
    def __init__(self, n: int):
        self.items = [models.batch("llama", batch_size=1, seed=i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.items[i].items()}


def _told(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not protrain_fx.optim.AdamW" in r.getMessage()]


def test_the_trainer_without_optimizers_says_once_that_nothing_is_chunked(tmp_path, caplog):
    """With no `optimizers=`, the Trainer steps the compiled model with torch's AdamW (built before the first step,
    whose forward compiles the model): it trains without chunks, and says so once, with what to pass. (It trained
    so with no word before.)"""
    model = models.build("llama")
    model.compile(backend=protrain_fx.ProTrainBackend(EAGER), dynamic=False)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
    )
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        Trainer(model=model, args=args, train_dataset=_Batches(6)).train()
    told = _told(caplog)
    assert len(told) == 1, told
    # (accelerate's wrapper of it left unnamed)
    assert "stepped by torch.optim.adamw.AdamW, not protrain_fx.optim.AdamW" in told[0]
    assert "optimizers=(protrain_fx.optim.AdamW(model.parameters(), lr=...), scheduler)" in told[0]
    assert protrain_fx.manager_of(model) is None


def test_the_trainer_compiles_with_torch_compile_backend_protrain(tmp_path):
    """`TrainingArguments(torch_compile_backend="protrain")`: accelerate, which takes only the backends its enum lists,
    raised "'PROTRAIN' is not a valid DynamoBackend". It compiles the model with protrain now, in chunks where
    `optimizers=` gives it protrain_fx.optim.AdamW, and trains it as the Trainer trains the eager model (bitwise:
    the eager executor; the Trainer clips every step)."""
    ref = models.build("llama")
    model = copy.deepcopy(ref)

    def trainer(net, opt, **kw):
        args = TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=2,
            per_device_train_batch_size=2,
            use_cpu=True,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
            **kw,
        )
        return Trainer(model=net, args=args, train_dataset=_Batches(4), optimizers=(opt, None))

    trainer(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)).train()
    compiled = trainer(model, protrain_fx.optim.AdamW(model.parameters(), lr=1e-2), torch_compile_backend="protrain")
    plugin = compiled.accelerator.state.dynamo_plugin
    plugin.options = EAGER  # (what TrainingArguments cannot set; inductor's compile on the CPU takes a minute)
    assert plugin.to_kwargs() == {"backend": "protrain", "options": EAGER}
    assert compiled.train().global_step == 2
    assert protrain_fx.manager_of(model) is not None
    state = protrain_fx.full_state_dict(model)
    assert all(torch.equal(state[name], value) for name, value in ref.state_dict().items())


def test_a_model_of_two_graphs_is_told_once(caplog):
    """A graph break: each graph's first compile looks for the optimizers of its parameters; the second keeps quiet
    about the optimizer the first named."""
    model = models.build("toy", graph_break_after=0)
    backend = protrain_fx.ProTrainBackend(EAGER)
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        train(torch.compile(model, backend=backend, dynamic=False), "toy", 2)  # (torch's AdamW)
    assert len([g for g in backend.graphs if g.param_map]) == 2
    assert len(_told(caplog)) == 1


def test_explain_says_nothing_and_leaves_the_word_to_training(caplog):
    """`explain` plans as protrain_fx.optim.AdamW would and needs no optimizer: no word; training the model afterwards
    with torch's AdamW is told."""
    model = models.build("toy")
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        protrain_fx.explain(model, models.batch("toy"), EAGER)
        assert not _told(caplog)
        torch._dynamo.reset()
        train(_compiled(model), "toy", 1)  # (torch's AdamW)
    assert len(_told(caplog)) == 1


def test_a_model_stepped_by_protrain_adamw_or_by_nothing_hears_nothing(caplog):
    """No word where protrain_fx.optim.AdamW steps the parameters, nor where no optimizer steps them (a backward
    alone, while another optimizer steps other parameters)."""
    with caplog.at_level(logging.WARNING, logger="protrain_fx"):
        model = models.build("llama")
        train(_compiled(model), "llama", 2, opt=protrain_fx.optim.AdamW(model.parameters(), lr=1e-2))
        torch._dynamo.reset()
        other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        plain = models.build("llama")
        models.loss_of("llama", _compiled(plain)(**models.batch("llama"))).backward()
        other.step()
    assert not _told(caplog)
