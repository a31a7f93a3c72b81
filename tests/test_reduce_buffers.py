"""ReduceBuffers on its own (protrain_fx/runtime/chunks/reduce_buffers.py): at most `count` buffers, made at their
first use and taken in turn, each zeroed when taken; shards only where asked for. On the CPU (no copy events)."""

from __future__ import annotations

import torch

from protrain_fx.runtime.chunks.reduce_buffers import ReduceBuffers

CPU = torch.device("cpu")


def test_buffers_are_taken_in_turn_zeroed_and_made_once():
    ring = ReduceBuffers(2, chunk_elems=6, shard_elems=None, dtype=torch.float32, device=CPU)
    first, i = ring.take()
    first.fill_(3.0)
    ring.read_by(i, None)
    second, j = ring.take()
    again, k = ring.take()
    assert (i, j, k) == (0, 1, 0) and again.data_ptr() == first.data_ptr() and again.eq(0).all()
    assert len(ring.device_tensors()) == 2 and second.numel() == 6 and ring.shards == []


def test_each_buffer_has_its_shard_where_gradients_are_reduce_scattered():
    ring = ReduceBuffers(3, chunk_elems=8, shard_elems=4, dtype=torch.bfloat16, device=CPU)
    _, i = ring.take()
    assert ring.shard(i).numel() == 4 and ring.shard(i).dtype == torch.bfloat16
    assert [t.numel() for t in ring.device_tensors()] == [8, 4]  # (one buffer made so far, with its shard)
