"""Batches of many shapes (fine-tuning data padded per batch): one set of graphs with symbolic sizes, one profile
and one plan for them, planned for the largest shape (backend/sizes.py, profiler/scaling.py).

Tolerance: bitwise. With the eager executor a graph with symbolic sizes runs the same aten ops as eager PyTorch on
every shape, chunks as in tests/test_chunk_parity.py.
"""

import copy
import dataclasses
import random

import models
import pytest
import torch
from helpers import train
from spawn import spawn_gloo

import protrain_fx
from protrain_fx.backend import sizes as backend_sizes
from protrain_fx.profiler import interpreter

# every chunk offloaded, one block checkpointed
PLAN = {"n_persist": 0, "n_buffer": 2, "n_checkpoint": 1}
LENGTHS = list(range(6, 64, 3))  # 20 lengths up to the test models' max_position_embeddings (64)
BATCH, LAST_BATCH = 4, 3  # (the epoch's last batch is partial)


def batches(kind: str, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """One batch per length in shuffled order, the last one partial; an encoder-decoder's labels (the decoder's
    length) vary apart from its inputs."""
    lengths = LENGTHS[:]
    random.Random(seed).shuffle(lengths)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, length in enumerate(lengths):
        size = LAST_BATCH if i == len(lengths) - 1 else BATCH
        ids = torch.randint(1, models.VOCAB, (size, length), generator=g)
        labels = torch.randint(1, models.VOCAB, (size, 2 + length // 2), generator=g) if kind == "bart" else ids.clone()
        out.append({"input_ids": ids, "labels": labels})
    return out


def train_both(kind: str, dynamic, options=None):
    """The model trained eagerly and compiled (eager executor, `PLAN`) on `batches`; both models, the losses and
    the backend."""
    ref = models.build(kind, dropout=0.1)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": PLAN, **(options or {})})
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    data = batches(kind)
    expected = train(ref, kind, len(data), opt=ref_opt, batch=data.__getitem__)
    losses = train(compiled, kind, len(data), opt=opt, batch=data.__getitem__)
    return (ref, expected), (model, losses), backend


@pytest.mark.parametrize(
    "kind, dynamic",
    [("llama", None), ("gpt_neox", True), ("qwen2", True), ("bart", True)],
    ids=["llama-default", "gpt_neox", "qwen2", "bart"],
)  # (LLaMA with dynamic=True: test_a_swapped_block_trains_like_eager_from_slots_sized_for_the_largest_shape)
def test_every_shape_trains_like_eager_through_one_plan(kind, dynamic, monkeypatch):
    profiled = []
    profile = interpreter.profile_iteration
    monkeypatch.setattr(
        "protrain_fx.backend.stages.profile_iteration", lambda *a, **k: profiled.append(1) or profile(*a, **k)
    )
    (ref, expected), (model, losses), backend = train_both(kind, dynamic)
    assert losses == expected
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name
    graphs = [g for g in backend.graphs if g.param_map]  # (not a graph of no parameters before the model's)
    # dynamic=True: one graph with symbolic sizes for every shape. The default compiles the first shape as it is,
    # then (Dynamo's automatic dynamic) a graph whose changed sizes are symbolic: the sequence lengths, and once
    # the partial last batch comes, the batch size too
    assert all(g.fit is not None for g in graphs[(0 if dynamic else 1) :])
    assert len(graphs) == 1 if dynamic else 2 <= len(graphs) <= 3
    profiles = sum(2 if g.fit is not None else 1 for g in backend.graphs if g.profile is not None)
    assert len(profiled) == profiles  # (each graph's once; a symbolic one's at two sizes)
    symbolic = [g for g in graphs if g.fit is not None]
    shapes = symbolic[0].shapes
    assert max(shapes.largest.values()) == 64  # the models' max_position_embeddings
    assert "planned for sizes" in str(protrain_fx.plan_of(model))


def test_a_swapped_block_trains_like_eager_from_slots_sized_for_the_largest_shape():
    (ref, expected), (model, losses), backend = train_both("llama", True, {"plan": {**PLAN, "n_swap": 1}})
    assert losses == expected
    state = protrain_fx.full_state_dict(model)
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name
    (record,) = [g for g in backend.graphs if g.fit is not None]
    assert record.plan.n_swap == 1 and record.swap is not None
    # each slot holds its tensor at the largest sizes planned: the saved bytes of the swapped block there
    swapped = record.plan.block_modes.index("swap")
    at_largest = record.fit.at({s: record.shapes.largest[str(s)] for s in record.fit.a})
    assert sum(r.numel() for r in record.swap.regions) >= at_largest.blocks[swapped].saved_bytes > 0


def test_steps_of_many_sizes_are_measured_at_the_planned_sizes(monkeypatch):
    """The step monitor scales each step by the plan's predicted time at the planned sizes over its predicted time
    at the step's own: steps whose time follows the prediction all measure as the planned step."""
    from protrain_fx.planner.plan import Plan
    from protrain_fx.runtime.monitor import StepMonitor

    predicted = {(): (8.0, 3.0, 5.0), (2, 16): (2.0, 1.0, 1.0), (2, 32): (4.0, 1.5, 2.5)}
    monitor = StepMonitor(
        torch.device("cpu"), Plan(predicted_step_s=8.0), None, at_sizes=lambda sizes, clipped: predicted[sizes]
    )
    clock = iter([0.0, 1.0, 3.0, 5.0, 9.0, 11.0, 15.0, 17.0, 21.0])  # 2 warmup steps, then 2, 4, 2, 4, 2, 4 seconds
    monkeypatch.setattr(monitor, "_now", lambda: next(clock))
    for sizes in [(2, 16), (2, 16), (2, 16), (2, 32), (2, 16), (2, 32), (2, 16), (2, 32), (2, 16)]:
        monitor.mark(sizes)
    assert monitor.report["measured_step_s"] == 8.0 and monitor.report["step_error"] == 0.0
    assert monitor.report["step_sizes"] == [[2, 16], [2, 32], [2, 16], [2, 32], [2, 16]]


def test_the_closed_loop_keeps_the_plan_of_a_graph_of_symbolic_sizes(monkeypatch, caplog):
    """A switch decided by the closed loop would compile the graph outside Dynamo at one call's sizes: the plan
    stays, said in a warning, and training goes on as eager's."""
    from protrain_fx.runtime.replan import ClosedLoop

    decide = ClosedLoop.decide

    def switching(self, record, manager, chunks_may_move):
        decide(self, record, manager, chunks_may_move)
        self.reason, self.switched = "(injected)", True
        return dataclasses.replace(record.plan, n_checkpoint=0), record.costs

    monkeypatch.setattr(ClosedLoop, "decide", switching)
    with caplog.at_level("WARNING", logger="protrain_fx.backend.guard"):
        (ref, expected), (model, losses), backend = train_both("llama", True)
    assert losses == expected
    (record,) = [g for g in backend.graphs if g.fit is not None]
    assert record.plan.n_checkpoint == PLAN["n_checkpoint"] and record.monitor.report["step_sizes"]
    assert "symbolic sizes and keeps its plan" in caplog.text


def test_the_plan_of_the_largest_shape_bounds_every_shape():
    """The plan is searched on the profile fitted at the largest sizes, whose peak bounds every shape's; the fit
    holds where it was measured. (The measured peak of each step against the plan's: bench/, on a GPU.)"""
    model = models.build("llama", dropout=0.1)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": PLAN})
    compiled = torch.compile(model, backend=backend, dynamic=True)
    data = batches("llama")
    train(compiled, "llama", len(data), opt=opt, batch=data.__getitem__)
    (record,) = [g for g in backend.graphs if g.fit is not None]
    fit = record.fit
    at_largest = fit.at({s: record.shapes.largest[str(s)] for s in fit.a})
    assert record.profile.peak_bytes == at_largest.peak_bytes  # (what the plan was searched on)
    batch_symbol, length_symbol = sorted(fit.a, key=lambda s: s in record.sizes.batch, reverse=True)
    for batch in data:
        size, length = batch["input_ids"].shape
        at = fit.at({batch_symbol: size, length_symbol: length})
        assert at.peak_bytes <= at_largest.peak_bytes and at.saved_bytes <= at_largest.saved_bytes
    # where measured the fit holds to 1%, never below (memory is counted storage by storage from the graph's
    # shapes; what the profiled run frees differently, views of several storages, lands within it)
    at_b = fit.at(fit.b)
    assert fit.profile_b.peak_bytes <= at_b.peak_bytes <= 1.01 * fit.profile_b.peak_bytes
    assert at_b.saved_bytes == pytest.approx(fit.profile_b.saved_bytes, rel=1e-3)


def test_a_bound_given_is_planned_for_and_a_longer_batch_plans_once_more():
    ref = models.build("llama")
    opt = protrain_fx.optim.AdamW(ref.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": PLAN, "max_seq_len": 24})
    compiled = torch.compile(ref, backend=backend, dynamic=True)
    for length in (10, 24, 17, 40, 12, 33):
        ids = torch.randint(0, models.VOCAB, (2, length))
        compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    first, second = [g for g in backend.graphs if g.fit is not None]
    assert max(first.shapes.largest.values()) == 24
    assert max(second.shapes.largest.values()) == 40  # (a bound given is not widened: the longer batch's length)


def test_no_plan_fitting_the_model_limit_plans_for_shorter(monkeypatch):
    """Where no plan fits the model's max_position_embeddings, the sequence bound halves until one does."""
    tried = []
    bounds = backend_sizes.GraphSizes.bounds

    def recorded(self, config, model):
        for largest, more in bounds(self, config, model):
            tried.append(max(largest.values()))
            yield largest, more

    monkeypatch.setattr(backend_sizes.GraphSizes, "bounds", recorded)
    model = models.build("llama")
    batch = {"input_ids": torch.randint(0, models.VOCAB, (2, 12))}
    batch["labels"] = batch["input_ids"]
    options = {"executor": "eager", "plan": {"n_swap": 0}}  # (memory that no checkpointing frees: nothing swapped)
    wide = protrain_fx.explain(model, batch, options, dynamic=True)
    assert "s" in str(wide) and "<= 64" in str(wide)
    # a GPU memory bound the widest plan does not fit (the profile's peak at length 64, less a little)
    tried.clear()
    needed = wide.predicted_peak_bytes
    narrow = protrain_fx.explain(
        model, batch, {**options, "gpu_memory_bytes": max(needed * 3 // 4, 2**16)}, dynamic=True
    )
    assert tried[0] == 64 and len(tried) > 1
    assert "<= 64" not in str(narrow)


@torch._dynamo.config.patch(recompile_limit=3)
def test_fixed_shapes_stop_before_dynamo_runs_the_model_uncompiled():
    model = models.build("llama")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}), dynamic=False)
    for length in (8, 12):
        ids = torch.randint(0, models.VOCAB, (2, length))
        compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ids = torch.randint(0, models.VOCAB, (2, 16))
    with pytest.raises(Exception, match="recompile_limit"):
        compiled(input_ids=ids, labels=ids)


def _tokenizer():
    """A word-level tokenizer over the test vocabulary, built here (no download), with a pad token."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(models.VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="t0")


def _trainer_run(out: str, compiled: bool) -> dict:
    """The Trainer on samples of 13 lengths, grouped by length and padded per batch (the last batch partial)."""
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    samples = models.samples_of_many_lengths(seed=1)
    model = models.build("llama")
    args = TrainingArguments(
        output_dir=out,
        num_train_epochs=1,
        learning_rate=1e-2,
        per_device_train_batch_size=2,
        train_sampling_strategy="group_by_length",  # (transformers 5: group_by_length=True before)
        logging_steps=1,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        seed=0,
    )
    if compiled:  # as the README shows it, Dynamo's default dynamic shapes
        model.compile(backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": PLAN}))
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=args.learning_rate)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, fused=True)
    collator = DataCollatorForSeq2Seq(_tokenizer(), label_pad_token_id=-100)  # (pads the labels too)
    trainer = Trainer(model=model, args=args, train_dataset=samples, data_collator=collator, optimizers=(opt, None))
    trainer.train()
    weights = protrain_fx.full_state_dict(model) if compiled else model.state_dict()
    logs = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]
    return {"logs": logs, "weights": weights}


def test_trainer_with_padding_per_batch_trains_like_eager(tmp_path):
    expected = _trainer_run(str(tmp_path / "eager"), compiled=False)
    ours = _trainer_run(str(tmp_path / "protrain"), compiled=True)
    assert len(ours["logs"]) == 7 and ours["logs"] == expected["logs"]
    for name, value in expected["weights"].items():
        assert torch.equal(ours["weights"][name], value), name


def test_inductor_compiles_one_graph_for_every_shape():
    """Inductor's dynamic kernels with the chunk passes: every shape through one graph, losses as eager's within
    fp32 reordering (inductor fuses and reorders reductions: rtol 1e-5)."""
    ref = models.build("llama", layers=1)  # (one block: inductor compiles each block's kernels)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"plan": PLAN})
    compiled = torch.compile(model, backend=backend, dynamic=True)
    data = batches("llama")[:4]
    expected = train(ref, "llama", len(data), opt=ref_opt, batch=data.__getitem__)
    losses = train(compiled, "llama", len(data), opt=opt, batch=data.__getitem__)
    assert losses == pytest.approx(expected, rel=1e-5)
    assert len([g for g in backend.graphs if g.fit is not None]) == 1


def _ranks_of_other_lengths(rank: int, world: int) -> None:
    import torch.distributed as dist

    model = models.build("llama", layers=1)  # (one block: the sizes planned for, not the model, are compared)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": {"n_persist": 0, "n_buffer": 2}})
    compiled = torch.compile(model, backend=backend, dynamic=True)
    lengths = [(9, 30, 17), (21, 12, 40)][rank]  # (each rank's first batch of another length)
    for length in lengths:
        ids = torch.randint(0, models.VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    (record,) = [g for g in backend.graphs if g.fit is not None]
    mine = (record.fit.a, record.shapes.largest, str(protrain_fx.plan_of(model)))
    every = [None] * world
    dist.all_gather_object(every, mine)
    assert all(other == every[0] for other in every), every
    assert max(record.fit.a.values()) == 21  # (the longest first batch of any rank)


def test_ranks_profile_and_plan_at_the_same_sizes():
    """Ranks whose first batches differ in length profile at the longest and plan alike (their chunks are sharded
    across them: a plan that differed would deadlock their collectives)."""
    spawn_gloo(_ranks_of_other_lengths, 2)


def _accelerate_run(compiled: bool) -> tuple:
    """accelerate's loop (test_accelerate.py: gradient accumulation over 2, clipping where gradients are complete, a
    schedule) over 13 lengths padded per batch by the data collator, the last batch partial."""
    from test_accelerate import _accelerator, _loop
    from torch.utils.data import DataLoader
    from transformers import DataCollatorForSeq2Seq, get_linear_schedule_with_warmup

    accelerator = _accelerator()
    model = models.build("llama")
    if compiled:  # Dynamo's default dynamic shapes
        model.compile(backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": PLAN}))
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    collator = DataCollatorForSeq2Seq(_tokenizer(), label_pad_token_id=-100)
    loader = DataLoader(models.samples_of_many_lengths(seed=2), batch_size=2, collate_fn=collator)
    sched = get_linear_schedule_with_warmup(opt, 2, 7)
    return _loop(accelerator, *accelerator.prepare(model, opt, sched, loader), clip_every_micro_batch=False)


def test_accelerate_with_padding_per_batch_trains_like_eager():
    expected, ours = _accelerate_run(compiled=False), _accelerate_run(compiled=True)
    assert len(ours[0]) == 7 and ours[0] == expected[0] and ours[1] == expected[1]
    for name, value in expected[2].items():
        assert torch.equal(ours[2][name], value), name
