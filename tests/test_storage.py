"""The ChunkStorage part on its own (protrain_fx/runtime/chunks/storage.py): the chunks' memory for a placement, built
again by the next; the gradient buffers and shards its pools lend; where this rank's elements of a chunk are; what a
pending storage holds of the host."""

from __future__ import annotations

import pytest
import torch

from protrain_fx.planner.chunking import ChunkLayout, Slot
from protrain_fx.runtime.chunks.storage import ChunkStorage

ELEMS = 8  # per chunk: two parameters of 4


def _storage(n_persist: int, *, world_size: int = 1, rank: int = 0, master: str = "float32") -> ChunkStorage:
    slots = tuple(Slot(f"p{i}", i // 2, (i % 2) * 4, 4) for i in range(6))
    layout = ChunkLayout(chunk_elems=ELEMS, element_size=4, world_size=world_size, slots=slots, n_chunk=3)
    return ChunkStorage(
        layout,
        n_persist=n_persist,
        dtype=torch.float32 if master == "float32" else torch.bfloat16,
        master_dtype_name=master,
        device=torch.device("cpu"),
        rank=rank,
        world_size=world_size,
        wait_for_a_give_back=lambda: False,
    )


def test_persistent_chunks_on_the_device_offloaded_shards_in_one_host_arena():
    storage = _storage(1, master="float32")
    storage.build(1, None, None)
    assert storage.master[0] is storage.flat[0]  # (fp32 parameters are their own master)
    assert set(storage.flat) == {0} and set(storage.master) == {0, 1, 2}
    # the offloaded masters and one gradient shard each, in the arena, every byte of it
    assert storage.arena.numel() == ELEMS * 4 * (2 + 2)
    arena = storage.arena.data_ptr()
    assert all(arena <= storage.master[c].data_ptr() < arena + storage.arena.numel() for c in (1, 2))
    assert set(storage.grad) == {0, 1, 2} and not storage.shares_grads and not storage.shares_device_grads


def test_a_bfloat16_model_keeps_fp32_masters_apart_from_its_parameters():
    storage = _storage(2, master="bfloat16")
    storage.build(2, None, None)
    assert storage.master[0] is storage.flat[0] and storage.master[0].dtype == torch.bfloat16
    fp32 = _storage(2, master="float32")
    fp32.dtype, fp32.own_master = torch.bfloat16, False  # (a bfloat16 model with fp32 masters)
    fp32.build(2, None, None)
    assert fp32.flat[0].dtype == torch.bfloat16 and fp32.master[0].dtype == torch.float32


def test_shared_gradient_shards_are_lent_in_turn_and_given_back():
    storage = _storage(0)
    storage.build(0, 2, None)
    assert storage.shares_grads and storage.grad_is_shared(1) and not storage.grad
    first, second = storage.host_grads.take(0), storage.host_grads.take(1)
    assert first.data_ptr() != second.data_ptr() and storage.host_grads.take(0) is first
    storage.host_grads.give_back(0)
    assert storage.host_grads.take(2) is first and set(storage.grad) == {1, 2}


def test_a_rebuild_places_the_chunks_anew_and_keeps_what_it_is_given():
    storage = _storage(1)
    storage.build(1, None, None)
    kept = (storage.flat[0], storage.master[0])
    storage.published(2)
    storage.build(2, None, None, kept={0: kept})
    assert (storage.flat[0], storage.master[0]) == kept and set(storage.flat) == {0, 1}
    assert storage.version(2) == 1 and storage.version(0) == 0  # (published updates outlive a placement)
    storage.drop_grads()
    assert not storage.grad and storage.device_grads is None
    with pytest.raises(AssertionError, match="let go"):
        storage.grad_is_shared(0)


@pytest.mark.parametrize("rank", [0, 1])
def test_this_ranks_pieces_of_a_sharded_chunk(rank):
    storage = _storage(1, world_size=2, rank=rank)
    assert storage.shard_bounds() == (4 * rank, 4 * rank + 4)
    assert not storage.is_sharded(0) and storage.is_sharded(1)
    # chunk 0 persistent: both parameters whole; chunk 1 offloaded: the parameter of this rank's half
    assert storage.param_pieces(0) == [(0, 0, 4, 0), (1, 4, 8, 0)]
    assert storage.param_pieces(1) == [(2 + rank, 0, 4, 0)]


def test_a_pending_storage_holds_each_master_on_its_own():
    storage = _storage(0)
    storage.build(0, None, None, pending=True)
    assert storage.arena.numel() == ELEMS * 4 * 3  # (the gradient shards only)
    assert storage.host_bytes() == 3 * ELEMS * 4 + storage.arena.numel()
    assert all(storage.master[c].untyped_storage().nbytes() == ELEMS * 4 for c in range(3))
