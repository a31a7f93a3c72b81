"""The Outside part on its own (protrain_fx/runtime/chunks/outside.py): offloaded parameters lent their values and
taken back, values loaded into the masters and published, in-place writes into persistent parameters taken into
their masters, what the compiled graphs read. Over a ChunkValues of its own: one rank, on the CPU, chunk 0 persistent
and chunk 1 offloaded, two parameters of 4 elements each."""

from __future__ import annotations

import torch
from torch import nn

from protrain_fx.planner.chunking import ChunkLayout, Slot
from protrain_fx.runtime.chunks.outside import Outside
from protrain_fx.runtime.chunks.step_state import StepState

ELEMS = 8


class Memory:
    """A ChunkMemory of one rank: chunk 0's parameters flat in `flat[0]`, each chunk's master in `master`."""

    def __init__(self, flat: dict[int, torch.Tensor], master: dict[int, torch.Tensor]):
        self.flat, self.master = flat, master

    def is_sharded(self, chunk: int) -> bool:
        return False

    def shard_bounds(self) -> tuple[int, int]:
        return 0, ELEMS


class Chunks:
    """A ChunkValues: chunk 0's parameters view `flat[0]` (master: a float64 copy), chunk 1's hold no storage (its
    master on the host holds 10 + the element's index). Publishes, waits and updates moved to the step are noted."""

    def __init__(self, own_master: bool = False):
        slots = [Slot(f"p{i}", i // 2, (i % 2) * 4, 4) for i in range(4)]
        self.layout = ChunkLayout(chunk_elems=ELEMS, element_size=4, world_size=1, slots=tuple(slots), n_chunk=2)
        self.slots, self.n_persist, self.world_size, self.own_master = slots, 1, 1, own_master
        self.device, self.dtype, self.step_state = torch.device("cpu"), torch.float32, StepState()
        flat = {0: torch.arange(ELEMS, dtype=torch.float32)}
        master_dtype = torch.float32 if own_master else torch.float64
        master = {
            0: flat[0] if own_master else flat[0].to(master_dtype),
            1: (10.0 + torch.arange(ELEMS)).to(master_dtype),
        }
        self.storage = Memory(flat, master)
        self.params = [nn.Parameter(flat[0][a : a + 4]) for a in (0, 4)]
        for _ in range(2):
            p = nn.Parameter(torch.empty(4))
            p.untyped_storage().resize_(0)
            self.params.append(p)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.published: list[int] = []
        self.waited: list[int | None] = []
        self.in_step: set[int] = set()

    def is_persistent(self, p: nn.Parameter) -> bool:
        return self.slots[self.index[id(p)]].chunk < self.n_persist

    def wait_for_update(self, chunk: int | None = None) -> None:
        self.waited.append(chunk)

    def join_early_updates(self) -> None:
        pass

    def publish(self, chunk: int) -> None:
        self.published.append(chunk)
        if chunk < self.n_persist and not self.own_master:
            self.storage.flat[chunk].copy_(self.storage.master[chunk])

    def update_in_step(self, chunk: int) -> None:
        self.in_step.add(chunk)


def test_offloaded_parameters_lent_for_a_forward_and_taken_back():
    chunks = Chunks()
    outside = Outside(chunks)
    outside.lend([0, 2, 3], for_backward=False)
    assert outside.lent == {2: False, 3: False} and not chunks.in_step  # (a persistent one holds its values)
    assert torch.equal(chunks.params[2].detach(), torch.tensor([10.0, 11, 12, 13]))
    assert torch.equal(chunks.params[3].detach(), torch.tensor([14.0, 15, 16, 17]))
    outside.take_back([2])
    assert outside.lent == {3: False} and chunks.params[2].untyped_storage().nbytes() == 0
    outside.lend([3], for_backward=True)  # (autograd may read it: lent until the step's end, updated in the step)
    assert outside.lent == {3: True} and chunks.in_step == {1}
    outside.take_back()
    assert outside.lent == {3: True}
    outside.take_back(all_of_them=True)
    assert not outside.lent and chunks.params[3].untyped_storage().nbytes() == 0


def test_a_value_loaded_goes_into_the_master_and_is_published():
    chunks = Chunks()
    outside = Outside(chunks)
    outside.load_param(1, torch.full((4,), -1.0))
    assert (
        chunks.storage.master[0][4:].eq(-1).all()
        and chunks.storage.flat[0][4:].eq(-1).all()
        and chunks.published == [0]
    )
    outside.lend([2], for_backward=False)
    outside.load_param(2, torch.full((4,), -2.0))  # (lent: its own storage takes the value too)
    assert chunks.storage.master[1][:4].eq(-2).all() and chunks.params[2].detach().eq(-2).all()
    assert chunks.published == [0, 1] and chunks.storage.master[1][4:].eq(torch.tensor([14.0, 15, 16, 17])).all()


def test_writes_into_a_persistent_parameter_go_into_its_master_once():
    chunks = Chunks()
    outside = Outside(chunks)
    outside.note_versions()
    with torch.no_grad():
        chunks.params[0].mul_(2)
    outside.take_writes()
    assert torch.equal(chunks.storage.master[0][:4], torch.tensor([0.0, 2, 4, 6], dtype=torch.float64))
    chunks.storage.master[0][:4] = 5  # (an update of the master since: no write of the parameter takes it back)
    outside.take_writes()
    assert chunks.storage.master[0][:4].eq(5).all()


def test_parameters_that_are_their_own_master_are_not_tracked():
    chunks = Chunks(own_master=True)
    outside = Outside(chunks)
    outside.note_versions()
    with torch.no_grad():
        chunks.params[0].add_(1)  # (the master itself)
    outside.take_writes()
    assert chunks.storage.master[0][:4].eq(torch.tensor([1.0, 2, 3, 4])).all()


def test_what_the_graphs_read_is_not_lent_and_only_after_the_first_step():
    chunks = Chunks()
    outside = Outside(chunks)
    outside.note_read_by_graph([chunks.params[2], nn.Parameter(torch.ones(1))], graph="g0")
    assert outside.read_by_graphs == {2} and outside.graphs_reading == {"g0"}
    outside.note_read_by_graph([], graph="g1")  # (a graph reading none of the chunks' parameters)
    assert outside.graphs_reading == {"g0"}
    assert outside.read_by_no_graph([2, 3]) == []  # (the first step: graphs may still read them)
    chunks.step_state.first = False
    assert outside.read_by_no_graph([2, 3]) == [3]
    outside.lend_to_python([2, 3], for_backward=False)
    assert outside.lent == {3: False}


def test_full_values_per_chunk_and_every_parameter_whole():
    chunks = Chunks()
    outside = Outside(chunks)
    assert torch.equal(outside.full_values(0), torch.arange(ELEMS, dtype=torch.float32))
    chunks.storage.master[0].add_(100)  # (updated during the backward: the master is current, the parameters not yet)
    chunks.step_state.early.add(0)
    assert torch.equal(outside.full_values(0), 100.0 + torch.arange(ELEMS))
    values = dict((id(p), v) for p, v in outside.full_params())
    assert torch.equal(values[id(chunks.params[3])], torch.tensor([14.0, 15, 16, 17])) and None in chunks.waited
    assert torch.equal(outside.param_values(2), torch.tensor([10.0, 11, 12, 13]))
