"""ChunkedParameter (runtime/chunks/param_class.py) on a prepared model, whose chunks are all offloaded until the
first compile places them: Python's calls read and write the chunks' values, one parameter lent at a time, and a
tensor sharing a parameter's storage from before its chunk moved is an error; on a trained model, `p.data = t` gives
the chunks `t`'s values. Tolerance: bitwise (fp32 on the CPU, the same values copied). In spawned processes: a read
of freed memory would end the process."""

from __future__ import annotations

import copy
import io

import models
import pytest
import torch
from spawn import in_a_process

import protrain_fx


def _in_a_process(target) -> None:
    exitcode = in_a_process(target)
    assert exitcode == 0, f"{target.__name__} ended with exit code {exitcode}"


def _prepared():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    ref = models.build("llama")
    return ref, protrain_fx.prepare(copy.deepcopy(ref), device="cpu")


def _reads_copies_and_foreach() -> None:
    ref, model = _prepared()
    manager = protrain_fx.manager_of(model)
    pairs = list(zip(ref.parameters(), model.parameters()))
    assert all(type(p).__name__ == "ChunkedParameter" and p.untyped_storage().nbytes() == 0 for _, p in pairs)
    with torch.no_grad():
        for a, b in pairs:
            assert repr(a) == repr(b) and torch.equal(a.detach(), b.detach()) and torch.equal(a[0] * 2, b[0] * 2)
    a, b = pairs[1]
    buffer = io.BytesIO()
    torch.save(b, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(b)):
        assert type(copied) is torch.nn.Parameter and torch.equal(copied, a) and copied.requires_grad
    array = b.detach().numpy()
    assert (array == a.detach().numpy()).all() and not array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        array[0] = 0
    lent_at_once = []
    lend = manager.outside.lend

    def counting(indices, *, for_backward):
        lent_at_once.append(len(manager.outside.lent) + len(indices))
        return lend(indices, for_backward=for_backward)

    manager.outside.lend = counting
    emas = [[p.detach().clone() for p in net.parameters()] for net in (ref, model)]
    with torch.no_grad():
        for ema, net in zip(emas, (ref, model)):
            torch._foreach_lerp_(ema, list(net.parameters()), 0.5)
    assert all(torch.equal(x, y) for x, y in zip(*emas)) and max(lent_at_once) == 1
    assert not manager.outside.lent and all(p.untyped_storage().nbytes() == 0 for _, p in pairs)
    (a, b), index = pairs[2], manager.index[id(pairs[2][1])]
    assert torch.equal((a * 2).detach(), (b * 2).detach())  # (recorded by autograd: lent until the step ends)
    assert manager.outside.lent == {index: True} and manager.slots[index].chunk in manager.eager_chunks


def test_reads_copies_and_foreach_calls_on_offloaded_parameters():
    """repr, views and elementwise ops give eager's values; torch.save and copy.deepcopy give plain parameters of
    them; NumPy gets a read-only copy (its memory is not the parameter's); an EMA's foreach lerp over every
    parameter lends one at a time; nothing stays lent, but a parameter a call under grad mode recorded for autograd,
    whose chunk's updates then wait for the step."""
    _in_a_process(_reads_copies_and_foreach)


def _writes_and_a_moved_chunk() -> None:
    ref, model = _prepared()
    name = "model.layers.1.mlp.down_proj.weight"
    p = model.get_parameter(name)
    data, detached = p.data, p.detach()
    with torch.no_grad():
        detached.mul_(2.0)  # (shares the parameter's version counter)
        ref.get_parameter(name).mul_(2.0)
        model.model.norm.weight.data.add_(1.0)  # (`.data`: a version counter of its own)
        ref.model.norm.weight.add_(1.0)
    state = protrain_fx.full_state_dict(model)
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    assert torch.equal(data, ref.get_parameter(name))
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": {"n_persist": 2}})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    models.loss_of("llama", compiled(**models.batch("llama", seed=0))).backward()
    opt.step()
    assert protrain_fx.manager_of(model).is_persistent(p)  # (the first compile's plan moved its chunk to the GPU)
    with pytest.raises(ValueError, match="take it from the parameter again"):
        data.sum()
    assert torch.equal(p.data, protrain_fx.full_state_dict(model)[name])


def test_writes_through_views_reach_the_chunks_and_a_view_from_before_a_move_is_an_error():
    """In-place writes through `p.detach()` and `p.data` of offloaded parameters reach their chunks; a `.data` taken
    while the chunk was offloaded and read after the first compile placed it on the device is an error that says
    what to do, not a read of the freed storage."""
    _in_a_process(_writes_and_a_moved_chunk)


def _data_assigned() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import OFFLOADED

    torch.manual_seed(0)
    ref = models.build("gpt2")  # (its embedding and output weight are one parameter)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": OFFLOADED})
    compiled = torch.compile(model, backend=backend, dynamic=False)

    def step(net, optimizer, i):
        loss = models.loss_of("gpt2", net(**models.batch("gpt2", seed=i)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    assert [step(ref, ref_opt, i) for i in range(2)] == [step(compiled, opt, i) for i in range(2)]
    manager = protrain_fx.manager_of(model)
    names = ["transformer.wte.weight", "transformer.h.1.mlp.c_proj.weight"]
    assert [manager.is_persistent(model.get_parameter(n)) for n in names] == [True, False]
    for net in (ref, model):
        for k, n in enumerate(names):
            p = net.get_parameter(n)
            p.data = torch.full_like(p, 0.01 * (k + 1))
            p.data = p  # (the same memory: nothing to take)
        net.to("cpu")  # (changes nothing: `p.data = p` for every parameter)
    assert [step(ref, ref_opt, i) for i in range(2, 4)] == [step(compiled, opt, i) for i in range(2, 4)]
    state = protrain_fx.full_state_dict(model)
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    with pytest.raises(ValueError, match=r"'transformer.wte.weight' lives in protrain chunks as a \(96, 32\)"):
        model.resize_token_embeddings(104)


def test_data_assigned_to_a_parameter_trains_on_as_eager_and_a_new_shape_is_an_error():
    """`p.data = t` on a persistent and an offloaded parameter after training began: their chunks take `t`'s values
    and training goes on as eager's, bitwise; `module.to()` changing nothing still works. A `t` of another shape
    (`resize_token_embeddings` after the chunks are built) is an error that says what to do, not a write past the
    parameter's storage, which ends the process."""
    _in_a_process(_data_assigned)
