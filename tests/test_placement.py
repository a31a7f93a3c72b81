"""The ChunkPlacement part (protrain_fx/runtime/chunks/placement.py), on a ChunkManager of four parameters in four
chunks, one rank on the CPU: the values moved into the chunks; a pending manager placed by its plan; a trained one's
chunks moved between the device and the host between steps, bitwise, and refused during a step; the host memory a
pending manager holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from protrain_fx.planner.chunking import ParamInfo, layout_at
from protrain_fx.runtime.chunks import ChunkManager

SIZES = (40, 48, 64, 36)  # (no two fit one chunk of 64)


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def _manager(params: list[nn.Parameter], **kw) -> ChunkManager:
    infos = [ParamInfo(f"p{i}", p.numel(), None) for i, p in enumerate(params)]
    layout = layout_at(infos, chunk_elems=64, element_size=4, world_size=1)
    assert layout.n_chunk == len(params)  # (one parameter a chunk)
    return ChunkManager(params, layout, **kw)


def _values(manager: ChunkManager) -> list[torch.Tensor]:
    """Each parameter's values as the chunks hold them (master or shard)."""
    storage = manager.storage
    return [storage.master[slot.chunk][slice(*storage.slot_range(slot))].clone() for slot in manager.slots]


def test_adopt_moves_every_value_into_its_chunk():
    params = _params()
    before = [p.detach().clone() for p in params]
    manager = _manager(params, n_persist=2, n_buffer=1)
    assert all(torch.equal(v, b) for v, b in zip(_values(manager), before))
    # persistent parameters view their flat chunk, offloaded ones hold no storage (their shape stays)
    assert params[0].data_ptr() == manager.storage.flat[0].data_ptr() and torch.equal(params[1].detach(), before[1])
    assert params[2].untyped_storage().nbytes() == 0 and params[3].shape == (36,)


def test_a_pending_manager_is_placed_by_its_plan_bitwise():
    params = _params()
    before = [p.detach().clone() for p in params]
    manager = _manager(params, n_persist=0, n_buffer=1, pending_plan={"n_buffer": 1})
    placement = manager.placement
    assert manager.pending_plan == {"n_buffer": 1} and placement.pending_host_bytes == manager.storage.host_bytes() > 0
    placement.place(3, 1, None, None)
    assert manager.pending_plan is None and placement.pending_host_bytes == 0
    assert (manager.n_persist, manager.n_buffer) == (3, 1)
    assert all(torch.equal(v, b) for v, b in zip(_values(manager), before))
    assert torch.equal(params[2].detach(), before[2]) and params[3].untyped_storage().nbytes() == 0
    with pytest.raises(AssertionError, match="wait for its plan"):
        placement.place(1, 1, None, None)


def test_chunks_move_up_and_down_between_steps_bitwise():
    params = _params()
    before = [p.detach().clone() for p in params]
    manager = _manager(params, n_persist=1, n_buffer=1)
    assert manager.placement.between_steps
    assert manager.placement.place_again(3, 1, None, None)  # two chunks up
    assert manager.n_persist == 3 and all(torch.equal(p.detach(), b) for p, b in zip(params[:3], before))
    assert manager.placement.place_again(0, 2, None, None)  # every chunk down
    assert (manager.n_persist, manager.n_buffer) == (0, 2)
    assert all(torch.equal(v, b) for v, b in zip(_values(manager), before))
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    with pytest.raises(ValueError, match="n_buffer=0"):
        manager.placement.place_again(1, 0, None, None)


def test_chunks_move_between_the_device_its_shards_and_the_host_bitwise():
    """Between persistent, sharded on the device (here one rank's shard is the whole chunk, updated where the
    device is) and offloaded, every way, the values stay; a pending manager is placed with shards on the device."""
    params = _params()
    before = [p.detach().clone() for p in params]
    manager = _manager(params, n_persist=1, n_buffer=1, n_device_shard=2)
    storage = manager.storage
    assert list(storage.device_sharded()) == [1, 2] and list(storage.offloaded()) == [3]
    assert storage.arena.numel() == 64 * 4 * 2  # (the one offloaded chunk's master and gradient shard)
    assert [storage.on_host(c) for c in range(4)] == [False, False, False, True]
    for n_persist, n_device_shard in [(0, 4), (2, 1), (0, 0), (1, 2), (4, 0), (0, 3)]:
        assert manager.placement.place_again(n_persist, 1, None, None, n_device_shard)
        assert (manager.n_persist, manager.n_device_shard) == (n_persist, n_device_shard)
        assert all(torch.equal(v, b) for v, b in zip(_values(manager), before)), (n_persist, n_device_shard)
        assert all(storage.grads_of(c) is storage.shard_grads for c in storage.device_sharded())
    with pytest.raises(ValueError, match="n_device_shard=4"):
        manager.placement.place_again(1, 1, None, None, 4)
    params = _params()
    pending = _manager(params, n_persist=0, n_buffer=1, pending_plan={"n_buffer": 1})
    pending.placement.place(1, 1, None, None, 2)
    assert (pending.n_persist, pending.n_device_shard) == (1, 2)
    assert all(torch.equal(v, b) for v, b in zip(_values(pending), before))


def test_no_placement_while_a_chunk_is_in_use():
    manager = _manager(_params(), n_persist=1, n_buffer=1)
    manager.gather(2)  # (a graph reads chunk 2 until it releases it)
    assert not manager.placement.between_steps
    with pytest.raises(AssertionError, match="during a step"):
        manager.placement.place_again(2, 1, None, None)
    manager.release(2)
    assert manager.placement.between_steps and manager.placement.place_again(2, 1, None, None)
