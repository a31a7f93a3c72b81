"""Training through the backend equals eager training.

Tolerance: the eager executor runs the same aten ops in the same order as eager PyTorch on CPU (fp32),
dropout included, so losses and parameters must be bitwise equal. The inductor executor fuses ops and
changes reduction order, so there fp32 results agree to 1e-4 relative after a few AdamW steps. On a GPU under bf16
autocast: helpers.BF16_RTOL.
"""

import models
import pytest
import torch
from helpers import BF16_RTOL, eager_and_protrain, train
from models import MODEL_KINDS


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_eager_executor_bitwise(kind):
    (eager_losses, ref), (losses, model), backend = eager_and_protrain(kind, steps=5)
    assert losses == eager_losses
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert all(g.profile is not None for g in backend.graphs)


@pytest.mark.parametrize("kind", ["toy", "gpt2"])
def test_eager_executor_bitwise_with_dropout(kind):
    (eager_losses, ref), (losses, model), _ = eager_and_protrain(kind, steps=3, dropout=0.1)
    assert losses == eager_losses
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_inductor_executor_equals_plain_torch_compile():
    """Same decompositions, partitioner and kernels as plain `torch.compile`: bitwise equal to it. Against eager,
    fused kernels round differently: losses agree to 1e-4; AdamW normalizes each update to about lr, so where a
    gradient is near zero a rounding difference can flip its sign: parameters agree to steps * lr. One block:
    inductor's compile time grows with the kernels of the graph."""
    (eager_losses, ref), (losses, model), backend = eager_and_protrain(
        "toy", steps=3, options={}, dropout=0.0, layers=1
    )
    assert backend.config.executor == "inductor"
    plain = models.build("toy", layers=1)
    plain_losses = train(torch.compile(plain, dynamic=False), "toy", 3)
    assert losses == plain_losses
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-6)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=3 * 1e-2)


def test_gpt2_has_two_graphs_both_trained():
    _, (losses, _), backend = eager_and_protrain("gpt2", steps=2, loss_break=True)
    assert len(backend.graphs) == 2
    loss_graph = backend.graphs[1]
    assert not loss_graph.block_map.families and not loss_graph.param_map
    assert loss_graph.profile.backward_s > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", models.MODEL_KINDS)
def test_inductor_bf16_parity(kind):
    (eager_losses, _), (losses, model), backend = eager_and_protrain(
        kind, steps=5, options={}, device="cuda", autocast=torch.bfloat16
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=BF16_RTOL, atol=1e-3)
    plain = models.build(kind).cuda()
    plain_losses = train(torch.compile(plain, dynamic=False), kind, 5, device="cuda", autocast=torch.bfloat16)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=BF16_RTOL, atol=1e-3)
    profiled = [g for g in backend.graphs if g.profile is not None]  # graphs needing no grad have no backward
    assert profiled and all(g.profile.device.startswith("cuda") for g in profiled)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["toy", "llama"])
def test_eager_executor_bf16_bitwise(kind):
    (eager_losses, ref), (losses, model), _ = eager_and_protrain(kind, steps=3, device="cuda", autocast=torch.bfloat16)
    assert losses == eager_losses
