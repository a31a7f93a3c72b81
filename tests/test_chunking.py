"""Chunk layout (planner/chunking.py): order, block alignment, waste, padding for any world size."""

import dataclasses

import pytest

from protrain_fx.planner.chunking import ALIGN, WASTE_TIE, ParamInfo, layout_at, search_layout


def toy_params(blocks=3, per_block=(1000, 3000, 500), embed=2000, head=1500):
    params = [ParamInfo("embed", embed, None)]
    for b in range(blocks):
        params += [ParamInfo(f"blocks.{b}.p{i}", n, b) for i, n in enumerate(per_block)]
    return params + [ParamInfo("head", head, None)]


def test_order_kept_and_nothing_overlaps():
    params = toy_params()
    layout = search_layout(params, element_size=4)
    assert [s.name for s in layout.slots] == [p.name for p in params]
    for c in range(layout.n_chunk):
        slots = layout.chunk_slots(c)
        ends = [s.offset + s.numel for s in slots]
        assert all(a.offset + a.numel <= b.offset for a, b in zip(slots, slots[1:]))
        assert max(ends) <= layout.chunk_elems
    chunks = [s.chunk for s in layout.slots]
    assert chunks == sorted(chunks)  # execution order never goes back to an earlier chunk


def test_a_block_stays_in_one_chunk_when_it_fits():
    params = toy_params()
    block = 4500  # elements per block
    layout = layout_at(params, chunk_elems=8 * 1024, element_size=4, world_size=1)
    for b in range(3):
        assert len({s.chunk for s in layout.slots if s.name.startswith(f"blocks.{b}.")}) == 1
    # at a size below the block, the block is split but each parameter stays whole
    small = layout_at(params, chunk_elems=3 * 1024, element_size=4, world_size=1)
    assert len({s.chunk for s in small.slots if s.name.startswith("blocks.0.")}) > 1
    assert block > 3 * 1024


def test_search_minimizes_waste_over_its_grid():
    params = toy_params()
    best = search_layout(params, element_size=2)
    # every aligned size of the search range: from the largest parameter (3000) to twice the largest block (9000)
    for elems in range(ALIGN * 47, 2 * 4500 + 1, ALIGN):
        assert best.waste_bytes <= layout_at(params, elems, 2, 1).waste_bytes


def test_sizes_wasting_a_hair_more_count_as_tied_and_the_largest_wins():
    """Many blocks of two equal parameters: chunks of one parameter waste least (only beside the embedding and the
    head), block-sized or larger ones a few thousand bytes more, under WASTE_TIE of the parameters' bytes: the
    search takes the larger chunks, half as many or fewer."""
    half = 8 * ALIGN
    params = [ParamInfo("embed", half // 2, None)]
    params += [ParamInfo(f"blocks.{b}.p{i}", half, b) for b in range(200) for i in range(2)]
    params += [ParamInfo("head", half // 2, None)]
    tight = layout_at(params, half, 2, 1)  # the grid's smallest size: the largest parameter
    best = search_layout(params, element_size=2)
    assert best.waste_bytes > tight.waste_bytes  # (a near tie, not a tie)
    assert best.waste_bytes <= tight.waste_bytes + WASTE_TIE * sum(p.numel for p in params) * 2
    assert best.chunk_elems >= 2 * half and best.n_chunk <= tight.n_chunk // 2
    # with three blocks any difference is over the tie (it is a multiple of ALIGN elements): the least waste wins
    few = params[:7] + params[-1:]
    least = search_layout(few, element_size=2)
    assert all(least.waste_bytes <= layout_at(few, e, 2, 1).waste_bytes for e in range(half, 4 * half + 1, ALIGN))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_padding_makes_equal_shards(world_size):
    layout = search_layout(toy_params(), element_size=2, world_size=world_size)
    assert layout.chunk_elems % (world_size * ALIGN) == 0
    assert layout.shard_elems * world_size == layout.chunk_elems
    total = sum(p.numel for p in toy_params())
    assert layout.waste_bytes == (layout.n_chunk * layout.chunk_elems - total) * 2


def test_forced_chunk_bytes():
    layout = search_layout(toy_params(), element_size=4, world_size=3, chunk_bytes=40_000)
    assert layout.chunk_elems == 10_176  # 10_000 rounded up to a multiple of 3 * 64
    with pytest.raises(ValueError, match="smaller than the largest parameter"):
        search_layout(toy_params(), element_size=4, chunk_bytes=1000)
    with pytest.raises(ValueError, match="no trainable parameters"):
        search_layout([], element_size=4)


def test_a_parameter_read_again_gets_a_chunk_of_its_own():
    """A tied embedding (read again by the head after the blocks) shares its chunk with nothing: gathered again,
    it loads itself alone, and the first block's chunk is not held across the forward with it."""
    params = [ParamInfo("embed", 2000, None, alone=True), *toy_params()[1:-1], ParamInfo("norm", 100, None)]
    for layout in (search_layout(params, element_size=4), layout_at(params, 8 * 1024, 4, 1)):
        assert [s.name for s in layout.chunk_slots(0)] == ["embed"]
        assert layout.slots[1].chunk == 1 and layout.slots[1].offset == 0
    # the same parameters without it: the first block shares the embedding's chunk
    shared = layout_at([dataclasses.replace(params[0], alone=False), *params[1:]], 8 * 1024, 4, 1)
    assert shared.slots[1].chunk == 0
    # in the middle of the order too: what follows it starts a chunk
    middle = layout_at([*params[1:4], dataclasses.replace(params[0], alone=True), *params[4:]], 8 * 1024, 4, 1)
    embed = next(s for s in middle.slots if s.name == "embed")
    assert [s.name for s in middle.chunk_slots(embed.chunk)] == ["embed"] and embed.offset == 0
