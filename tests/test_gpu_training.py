"""GPU checks of the training-loop features: sharded checkpoints, inf/NaN handling, accumulation with clipping,
and Hugging Face export, with chunks on the GPU and in pinned host memory (copy streams, CPU AdamW).
Run on a GPU machine: `python -m pytest -m gpu tests/test_gpu_training.py`.

Tolerances: loaded weights and states are compared bitwise; losses of two runs of the same steps to 1e-3
(the embedding backward accumulates with atomics, whose order varies on a GPU); against eager fp32 under bf16
autocast, the bf16 tolerance (helpers.BF16_RTOL).
"""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import BF16_RTOL, train

import protrain_fx

pytestmark = pytest.mark.gpu
PLAN = {"n_persist": 1, "n_buffer": 2}  # one chunk on the GPU, the rest offloaded


def _model_and_optimizer(**kw):
    model = protrain_fx.prepare(models.build("llama", layers=4).to(torch.bfloat16), plan=PLAN)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3, **kw)
    # (a backend object per model: torch.compile would reuse one model's graphs for the next under the same one)
    return model, opt, torch.compile(model, backend=protrain_fx.ProTrainBackend(), dynamic=False)


def _steps(compiled, opt, steps, start=0):
    return train(compiled, "llama", steps, opt=opt, first_step=start, device="cuda")


def _flat(state) -> dict[str, torch.Tensor]:
    """Every tensor of a protrain_fx.state_dict on the CPU, by its path (one rank: plain tensors)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _flat(value).items()})
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to("cpu", copy=True)
    return out


def test_checkpoint_resumes_on_gpu(tmp_path):
    model, opt, compiled = _model_and_optimizer()
    _steps(compiled, opt, 3)
    saved = _flat(protrain_fx.state_dict(model, opt))
    dcp.save(protrain_fx.state_dict(model, opt), checkpoint_id=tmp_path)
    expected = _steps(compiled, opt, 3, start=3)

    model, opt, compiled = _model_and_optimizer()
    state = protrain_fx.state_dict(model, opt)
    dcp.load(state, checkpoint_id=tmp_path)
    protrain_fx.load_state_dict(model, opt, state)
    loaded = _flat(protrain_fx.state_dict(model, opt))
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert _steps(compiled, opt, 3, start=3) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_nan_gradient_on_gpu(nonfinite):
    """A NaN loss at step 2 (offloaded updates start during the backward then): "raise" stops before any weight
    changes, "skip" skips the step; either way the weights are those before it."""
    model, opt, compiled = _model_and_optimizer(nonfinite=nonfinite)
    _steps(compiled, opt, 2)
    before = protrain_fx.full_state_dict(model)
    batch = {k: v.cuda() for k, v in models.batch("llama", seed=2).items()}
    (compiled(**batch).loss * float("nan")).backward()
    if nonfinite == "raise":
        with pytest.raises(FloatingPointError, match="inf or NaN"):
            opt.step()
    else:
        opt.step()
        assert opt.last_step_skipped
    opt.zero_grad()
    after = protrain_fx.full_state_dict(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(torch.isfinite(v).all() for st in opt.state_dict()["state"].values() for v in st.values())
    if nonfinite == "skip":
        assert all(torch.isfinite(torch.tensor(x)) for x in _steps(compiled, opt, 2, start=3))


def test_accumulation_and_clipping_on_gpu():
    """2 micro-batches accumulated with no_sync, gradients clipped to norm 0.5: against eager fp32 under bf16
    autocast doing the same with torch's clip_grad_norm_."""
    ref = models.build("llama", layers=4).cuda()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    protrain_fx.prepare(model, plan=PLAN)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(), dynamic=False)
    for step in range(4):  # (its own loop: accumulation and clipping, as a user writes them, are what is tested)
        micro = [{k: v.cuda() for k, v in models.batch("llama", seed=2 * step + i).items()} for i in range(2)]
        for batch in micro:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                (ref(**batch).loss / 2).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        with protrain_fx.no_sync(model):
            (compiled(**micro[0]).loss / 2).backward()
        (compiled(**micro[1]).loss / 2).backward()
        norm = protrain_fx.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
        assert norm.item() == pytest.approx(ref_norm.item(), rel=5 * BF16_RTOL), step
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss = ref(**micro[0]).loss.item()
    assert compiled(**micro[0]).loss.item() == pytest.approx(ref_loss, rel=BF16_RTOL)


def test_save_pretrained_after_gpu_training(tmp_path):
    from transformers import AutoModelForCausalLM

    model, opt, compiled = _model_and_optimizer()
    _steps(compiled, opt, 3)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").cuda()
    full = protrain_fx.full_state_dict(model)
    assert all(torch.equal(v.cpu().to(full[k].dtype), full[k]) for k, v in loaded.state_dict().items())


def test_inference_on_offloaded_chunks_on_gpu():
    """model.eval() under no_grad after training, chunks in pinned host memory gathered through the copy stream:
    the loss of the same weights run eagerly in bf16, and a training step after it goes on as before."""
    model = protrain_fx.prepare(models.build("llama", layers=4).to(torch.bfloat16), plan=PLAN)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    backend = protrain_fx.ProTrainBackend()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    _steps(compiled, opt, 2)
    batch = {k: v.cuda() for k, v in models.batch("llama", seed=9).items()}
    model.eval()
    with torch.no_grad():
        got = compiled(**batch).loss.item()
    ref = models.build("llama", layers=4).to(torch.bfloat16).cuda().eval()
    ref.load_state_dict(protrain_fx.full_state_dict(model))
    with torch.no_grad():
        expected = ref(**batch).loss.item()
    assert got == pytest.approx(expected, rel=BF16_RTOL)
    inference = backend.graphs[-1].forward
    assert any(n.target is torch.ops.protrain.gather.default for n in inference.graph.nodes)
    model.train()
    assert all(torch.isfinite(torch.tensor(_steps(compiled, opt, 1, start=2))))


def test_out_of_memory_is_replanned_and_training_finishes(caplog):
    """The planner is told the card has 16 GiB and plans on the whole card; after two steps the process may use
    three quarters of what the plan's second step reserved at its peak (a per-process memory fraction): a step
    runs out of memory, and on_oom="replan" re-plans under 90% of that, and lower while it still runs out, and
    goes on. 5 steps finish, with at most one lost (a backward that ran out of memory): up to it the losses are,
    to the bf16 tolerance, those of a run planned for the 90% from the start, and the step after it repeats its
    loss (same batch, weights unchanged). The card shrinks by what the plan was measured to need, not to a fixed
    size: how much the plan the search picks for 16 GiB needs depends on the machine's hardware profile."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from protrain_fx.runtime.oom import SHRINK

    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=8,
        max_position_embeddings=1024,
    )
    config._attn_implementation = "sdpa"
    total = torch.cuda.mem_get_info()[1]
    batch = {k: v.cuda() for k, v in models.batch("llama", batch_size=8, seq=1024).items()}

    def train(options, shrink_at=None):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).cuda().to(torch.bfloat16)
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
        backend = protrain_fx.ProTrainBackend(options)
        compiled = torch.compile(model, backend=backend, dynamic=False)
        losses, skipped, first_plan, card = [], [], None, None
        try:
            with caplog.at_level("WARNING", logger="protrain_fx"):
                for step in range(5):  # (its own loop: the card shrinks under it)
                    if shrink_at is not None and step == shrink_at - 1:
                        torch.cuda.reset_peak_memory_stats()
                    if step == shrink_at:  # the card shrinks under the plan
                        first_plan = backend.graphs[0].plan
                        card = torch.cuda.max_memory_reserved() * 3 // 4
                        torch.cuda.empty_cache()
                        torch.cuda.set_per_process_memory_fraction(card / total)
                    loss = compiled(**batch).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                    skipped.append(opt.last_step_skipped)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        graph = backend.graphs[0]
        del model, opt, compiled, backend
        torch.cuda.empty_cache()
        return losses, skipped, first_plan, graph, card

    losses, skipped, first, replanned, card = train({"gpu_memory_bytes": 16 * 2**30, "on_oom": "replan"}, 2)
    reference, _, _, planned, _ = train({"gpu_memory_bytes": int(card * SHRINK)})
    print(
        f"first plan for 16 GiB: {first.block_modes} n_persist {first.n_persist}, predicted peak "
        f"{first.predicted_peak_bytes}; card shrunk to {card}; planned for {int(card * SHRINK)}: "
        f"{planned.plan.block_modes} n_persist {planned.plan.n_persist}, predicted peak "
        f"{planned.plan.predicted_peak_bytes}; re-planned: {replanned.plan.block_modes} n_persist "
        f"{replanned.plan.n_persist} under {replanned.capacity}; losses {losses} (skipped {skipped}) vs {reference}"
    )
    assert "re-plan 1 of at most" in caplog.text and replanned.capacity < card * SHRINK + 2**20
    assert first.predicted_peak_bytes > card  # (the first plan did not fit the shrunk card)
    assert replanned.plan.predicted_peak_bytes < first.predicted_peak_bytes
    assert sum(skipped) <= 1 and all(torch.isfinite(torch.tensor(losses)))
    upto = skipped.index(True) if any(skipped) else len(losses)  # (a lost step changes every later one)
    if upto + 1 < len(losses):
        assert losses[upto + 1] == pytest.approx(losses[upto], rel=1e-3)
    assert losses[:upto] == pytest.approx(reference[:upto], rel=BF16_RTOL)
