"""The Gatherer on its own (protrain_fx/runtime/chunks/gather.py): chunks loaded into the device buffers from the
masters a ChunkSource gives, kept while current, evicted least recently released first, a master shard cast
through the landing shard. On the CPU (no copy stream); one rank."""

from __future__ import annotations

import pytest
import torch

from protrain_fx.runtime.chunks.gather import Gatherer

ELEMS = 8


class Source:
    """A ChunkSource over host masters of its own: chunk c's master holds c + its version; loads are counted."""

    def __init__(self, n_chunk: int, dtype=torch.float32):
        self.versions = dict.fromkeys(range(n_chunk), 0)
        self.dtype, self.loads, self.pending, self.waited = dtype, [], set(), []

    def master_shard(self, chunk: int) -> torch.Tensor:
        self.loads.append(chunk)
        return torch.full((ELEMS,), chunk + self.versions[chunk] + 0.25, dtype=self.dtype)

    def version(self, chunk: int) -> int:
        return self.versions[chunk]

    def update_pending(self, chunk: int) -> bool:
        return chunk in self.pending

    def wait_for_update(self, chunk: int | None = None) -> None:
        self.waited.append(chunk)
        self.pending.discard(chunk)


def _gatherer(source: Source, n_buffer: int = 2, dtype=torch.float32, landing=None) -> Gatherer:
    cpu = torch.device("cpu")
    return Gatherer(
        source,
        n_buffer=n_buffer,
        chunk_elems=ELEMS,
        shard=(0, ELEMS),
        dtype=dtype,
        landing_dtype=landing,
        device=cpu,
        world_size=1,
    )


def test_a_chunk_is_loaded_once_while_current_and_again_after_its_update():
    source = Source(3)
    g = _gatherer(source)
    assert g.gather(1).eq(1.25).all() and source.loads == [1] and source.waited == [1]
    g.release(1)
    assert g.gather(1).eq(1.25).all() and source.loads == [1]  # (still resident, same version: no copy)
    g.release(1)
    source.versions[1] = 1  # (its host update published)
    assert g.gather(1).eq(2.25).all() and source.loads == [1, 1]


def test_the_least_recently_released_chunk_is_evicted_and_chunks_in_use_never_are():
    source = Source(4)
    g = _gatherer(source)
    first, second = g.gather(0), g.gather(1)
    with pytest.raises(RuntimeError, match="needs a buffer but all 2 hold chunks in use \\[0, 1\\]"):
        g.gather(2)
    g.release(1)
    g.release(0)
    assert g.gather(2).data_ptr() == second.data_ptr()  # (1 was released first)
    assert g.gather(3).data_ptr() == first.data_ptr()
    assert g.in_use == {2, 3} and g.gather(2).eq(2.25).all()


def test_prefetch_loads_ahead_only_a_chunk_whose_update_is_done():
    source = Source(3)
    g = _gatherer(source)
    source.pending.add(2)
    g.prefetch(2)
    assert source.loads == []  # (its update is still queued: the gather loads it)
    source.pending.clear()
    g.prefetch(2)
    assert source.loads == [2]
    assert g.gather(2).eq(2.25).all() and source.loads == [2]  # (the gather finds it loaded)


def test_abandon_releases_every_chunk_in_use_and_drop_lets_the_buffers_go():
    source = Source(2)
    g = _gatherer(source)
    g.gather(0), g.gather(1)
    g.abandon_step()
    assert g.in_use == set()
    g.gather(0)  # (still resident: no copy)
    assert source.loads == [0, 1]
    g.drop()
    assert g.device_tensors() == []


def test_a_master_of_another_dtype_lands_then_is_cast_into_the_buffer():
    source = Source(1)
    g = _gatherer(source, n_buffer=1, dtype=torch.bfloat16, landing=torch.float32)
    assert [t.dtype for t in g.device_tensors()] == [torch.bfloat16, torch.float32]
    assert g.gather(0).dtype == torch.bfloat16 and g.gather(0).eq(0.25).all()
