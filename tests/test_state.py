"""Checkpoints: sharded through torch.distributed.checkpoint (DCP) at one world size and resumed at another,
full state dicts, and Hugging Face `save_pretrained`.

Tolerance: bitwise where the resumed run does the same arithmetic as the uninterrupted one (one rank, or 2
ranks, whose averaged gradient (g + g) / 2 is exactly g); at 3 ranks (g + g + g) / 3 rounds, so losses
agree to 1e-5 (as in test_chunk_distributed.py).
"""

import copy
import functools
import math

import models
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import OFFLOADED, train
from spawn import spawn_gloo

import protrain_fx
from protrain_fx.runtime.state import boxes

SAVED_AT = 3  # steps before the checkpoint
RESUMED = 3  # steps after it


def _train(kind, plan, start, steps, *, load=None, save=None, prepare=False, dtype=torch.float32, **model_kw):
    """Build the model and optimizer, load the checkpoint `load` (DCP directory, or a path of a whole state
    dict saved with torch.save), train steps `start` to `start + steps` on their batches, save to `save`;
    the losses. `prepare`: build the chunks (protrain_fx.prepare) before loading, else the first step builds
    them after the load."""
    model = models.build(kind, **model_kw).to(dtype)
    if prepare:
        protrain_fx.prepare(model, plan=plan, device="cpu")
    opt = protrain_fx.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    if load is not None:
        state = protrain_fx.state_dict(model, opt)
        if str(load).endswith(".pt"):
            state = torch.load(load, weights_only=False)
        else:
            dcp.load(state, checkpoint_id=load)
        protrain_fx.load_state_dict(model, opt, state)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": {} if prepare else plan})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    losses = train(compiled, kind, steps, opt=opt, first_step=start)
    if save is not None:
        dcp.save(protrain_fx.state_dict(model, opt), checkpoint_id=save)
    return losses


def _uninterrupted(kind="toy", plan=OFFLOADED, **kw):
    return _train(kind, plan, 0, SAVED_AT + RESUMED, **kw)


def _save_rank(path, expected, rank, world):
    losses = _train("toy", OFFLOADED, 0, SAVED_AT, save=path)
    assert losses == expected, (losses, expected)


def _resume_rank(paths, expected, prepare, rank, world):
    """Resumed from each of `paths` in turn (a fresh model each time)."""
    for path in paths:
        losses = _train("toy", OFFLOADED, SAVED_AT, RESUMED, load=path, prepare=prepare)
        if world & (world - 1) == 0:
            assert losses == expected, (path, losses, expected)
        else:
            assert losses == pytest.approx(expected, rel=1e-5), (path, losses, expected)


def test_boxes_cover_a_flat_range_contiguously():
    for shape in [(3, 4), (2, 3, 5), (7,), (), (4, 1, 3)]:
        n = math.prod(shape)
        for start in range(n + 1):
            for end in range(start, n + 1):
                at, hit = start, torch.zeros(shape)
                for offsets, sizes in boxes(start, end, shape):
                    first = sum(o * math.prod(shape[i + 1 :]) for i, o in enumerate(offsets))
                    assert first == at, (shape, start, end)  # contiguous, in order
                    at += math.prod(sizes)
                    hit[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
                assert at == end and hit.sum() == end - start and hit.reshape(-1)[start:end].eq(1).all()
                assert len(boxes(start, end, shape)) <= max(1, 2 * len(shape) - 1)


def test_sharded_checkpoint_resumes_at_other_world_sizes(tmp_path):
    """Saved sharded by 2 ranks (offloaded chunks: each rank writes its own pieces), resumed at 1 and 3 ranks,
    before the first step (chunks built after the load) and after protrain_fx.prepare (loaded into the
    chunks): the resumed steps equal the uninterrupted run's. The same checkpoint consolidated into one file (DCP's
    dcp_to_torch_save) loads into the 3 ranks' shards too."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reference = _uninterrupted()
    saved, whole = tmp_path / "ckpt", tmp_path / "whole.pt"
    spawn_gloo(functools.partial(_save_rank, str(saved), reference[:SAVED_AT]), 2)
    assert _train("toy", OFFLOADED, SAVED_AT, RESUMED, load=saved) == reference[SAVED_AT:]
    dcp_to_torch_save(saved, whole)
    spawn_gloo(functools.partial(_resume_rank, [str(saved), str(whole)], reference[SAVED_AT:], True), 3)


@pytest.mark.parametrize("master_dtype", ["float32", "bfloat16"])
def test_bf16_resume_keeps_the_masters(tmp_path, master_dtype):
    """A bf16 model's checkpoint holds its master weights and AdamW states, fp32 by default (bf16 weights alone
    would not resume exactly), bf16 with the plan's master_dtype "bfloat16": resuming (before the chunks are
    built, or into them) gives the uninterrupted run's losses exactly."""
    plan = {"n_persist": 1, "n_buffer": 2, "master_dtype": master_dtype}
    reference = _uninterrupted("llama", plan, dtype=torch.bfloat16)
    _train("llama", plan, 0, SAVED_AT, save=tmp_path / "ckpt", dtype=torch.bfloat16)
    saved = dcp.FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata
    stored = {md.properties.dtype for key, md in saved.items() if key.startswith("model.") or "exp_avg" in key}
    assert stored == {getattr(torch, master_dtype)}
    for prepare in (False, True):
        resumed = _train(
            "llama", plan, SAVED_AT, RESUMED, load=tmp_path / "ckpt", prepare=prepare, dtype=torch.bfloat16
        )
        assert resumed == reference[SAVED_AT:], prepare


def test_state_dict_and_save_pretrained_hold_the_trained_weights(tmp_path):
    """After training with offloaded chunks (their parameters' storage emptied), `model.state_dict()` and
    `save_pretrained` give the trained weights: `from_pretrained` computes the logits of an eager model given
    those weights, bitwise, and the compiled model's up to rounding."""
    from transformers import AutoModelForCausalLM

    model = models.build("llama")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": {"n_persist": 0, "n_buffer": 2}})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    train(compiled, "llama", 3, opt=opt)
    assert all(p.untyped_storage().size() == 0 for p in model.parameters())
    full = protrain_fx.full_state_dict(model)
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
    assert all(v is p for v, p in zip(model.state_dict(keep_vars=True).values(), model.parameters()))
    model.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    batch = models.batch("llama", seed=7)
    eager = models.build("llama")
    eager.load_state_dict(full)
    assert torch.equal(loaded(**batch).logits, eager(**batch).logits)
    # the compiled graph runs AOTAutograd's decomposed ops: the same logits up to rounding
    torch.testing.assert_close(loaded(**batch).logits, compiled(**batch).logits, rtol=1e-5, atol=1e-5)


def test_checkpoint_errors():
    model = models.build("toy")
    opt = protrain_fx.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="protrain_fx.optim.AdamW states, got AdamW"):
        protrain_fx.state_dict(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="takes the model"):
        protrain_fx.state_dict(opt)
    with pytest.raises(ValueError, match="not the model's"):
        protrain_fx.state_dict(models.build("toy"), opt)
    state = protrain_fx.state_dict(model, opt)
    del state["model"][next(iter(state["model"]))]
    with pytest.raises(ValueError, match="the state to load has no model entries"):
        protrain_fx.load_state_dict(copy.deepcopy(model), None, state)
    with pytest.raises(ValueError, match="expected the dict protrain_fx.state_dict"):
        protrain_fx.load_state_dict(model, opt, {"weights": {}})
    with pytest.raises(ValueError, match="no optimizer entries"):
        protrain_fx.load_state_dict(model, opt, {"model": protrain_fx.state_dict(model)["model"]})
