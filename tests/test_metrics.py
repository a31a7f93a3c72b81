"""StepMetrics: the one-line training log a user turns on."""

import models
import pytest
import torch

import protrain_fx


def test_a_line_every_n_steps(caplog):
    model = models.build("toy")
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}), dynamic=False)
    metrics = protrain_fx.StepMetrics(compiled, every=2)
    rows = []
    with caplog.at_level("INFO", logger="protrain_fx.metrics"):
        for step in range(4):  # (its own loop: StepMetrics.step is called in it, as a user calls it)
            batch = models.batch("toy", seed=step)
            loss = compiled(**batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rows.append(metrics.step(loss, tokens=batch["input_ids"].numel()))
    assert rows[0] is None and rows[2] is None and [r["step"] for r in rows[1::2]] == [2, 4]
    n_params = sum(p.numel() for p in model.parameters())
    for row in rows[1::2]:
        assert row["tokens_per_s"] > 0 and row["tflops"] == pytest.approx(6 * n_params * row["tokens_per_s"] / 1e12)
        assert row["gpu_peak_bytes"] is None and row["host_peak_bytes"] > 0  # (on the CPU: no GPU figure)
    lines = [r.getMessage() for r in caplog.records if r.name == "protrain_fx.metrics"]
    assert len(lines) == 2 and lines[1].startswith(f"step 4 | loss {rows[3]['loss']:.4f} | ")
    assert "tokens/s | " in lines[1] and "TFLOP/s | GPU peak - | host peak " in lines[1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive number of steps"):
        protrain_fx.StepMetrics(models.build("toy"), every=0)
    with pytest.raises(TypeError, match="takes the model"):
        protrain_fx.StepMetrics("model")
