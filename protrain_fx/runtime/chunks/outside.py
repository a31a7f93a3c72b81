"""Outside: the model used outside the compiled graphs (runtime/model_hooks.py, state dicts, checkpoints).

A part the ChunkManager composes (`manager.outside`), holding all of its state:
- `read_by_graphs`: parameters (indices) some compiled graph reads;
- `graphs_reading`: the keys of those graphs (where more than one reads the chunks, a re-plan keeps them where they
  are: backend/guard.py);
- `lent`: offloaded parameters holding values of their own for a forward that Python runs -> whether the backward
  may still read them;
- `_versions`: the persistent parameters' versions as the runtime left them (where they are not their own master).

Reads of the parameters' current values (`param_values`, `full_values`, `full_params`: collectives where a chunk
is sharded), writes into them (`load_param`; in-place writes into persistent parameters taken into their masters,
`take_writes`), and offloaded parameters lent storage of their own for a forward that Python runs (`lend`,
`take_back`). What it reads and writes of the chunks, it does through `ChunkValues` (the manager).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from protrain_fx.distributed import across_ranks
from protrain_fx.planner.chunking import ChunkLayout, Slot
from protrain_fx.runtime.chunks.param_class import as_plain
from protrain_fx.runtime.chunks.step_state import StepState


class ChunkMemory(Protocol):
    """What an Outside reads of the chunks' memory (the ChunkStorage)."""

    # chunk -> its master (persistent: whole, on the device; offloaded: this rank's shard)
    master: dict[int, torch.Tensor]
    flat: dict[int, torch.Tensor]  # persistent chunk -> its compute-dtype parameters, flat

    def is_sharded(self, chunk: int) -> bool: ...

    def shard_bounds(self) -> tuple[int, int]:
        """This rank's elements of an offloaded chunk."""
        ...


class ChunkValues(Protocol):
    """What an Outside reads of the chunks (the ChunkManager)."""

    params: list[nn.Parameter]
    slots: list[Slot]
    index: dict[int, int]  # id(parameter) -> its index in `params`
    layout: ChunkLayout
    world_size: int
    device: torch.device
    dtype: torch.dtype
    own_master: bool  # the parameters are their own master (persistent ones change with it)
    step_state: StepState

    @property
    def n_persist(self) -> int: ...

    @property
    def storage(self) -> ChunkMemory: ...

    def is_persistent(self, p: nn.Parameter) -> bool: ...

    def wait_for_update(self, chunk: int | None = None) -> None: ...

    def join_early_updates(self) -> None:
        """The compute stream waits for the persistent updates started during the backward."""
        ...

    def publish(self, chunk: int) -> None:
        """A chunk's master changed: its parameters (or its next gather) take it."""
        ...

    def update_in_step(self, chunk: int) -> None:
        """`chunk`'s update runs in `AdamW.step()` (a parameter of it was read outside the graphs)."""
        ...


class Outside:
    """The model outside the compiled graphs (module docstring)."""

    def __init__(self, chunks: ChunkValues):
        self._chunks = chunks
        self.read_by_graphs: set[int] = set()
        self.graphs_reading: set[object] = set()
        self.lent: dict[int, bool] = {}
        self._versions: dict[int, int] = {}

    def note_versions(self) -> None:
        """The parameters of persistent chunks that are not their own master, at their version now (the chunks were
        built or placed): what is written into them from outside later is taken into their masters (`take_writes`)."""
        c = self._chunks
        self._versions = {i: p._version for i, p in enumerate(c.params) if not c.own_master and c.is_persistent(p)}

    def take_writes(self) -> None:
        """Parameters of a persistent chunk written in place from outside the runtime (`nn.init`, a user's
        `p.mul_(...)`: their version moved; the runtime writes their chunk, not them) take their masters with
        them, where the parameters are not their own master."""
        c = self._chunks
        for i, version in self._versions.items():
            p = c.params[i]
            if p._version != version:
                slot = c.slots[i]
                c.join_early_updates()
                c.storage.master[slot.chunk][slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
                self._versions[i] = p._version

    def param_values(self, i: int) -> torch.Tensor:
        """Parameter `i`'s current values, whole, in the compute dtype on the chunks' device (a collective where its
        chunk is sharded)."""
        c = self._chunks
        slot = c.slots[i]
        c.wait_for_update(slot.chunk)
        if slot.chunk < c.n_persist:
            return c.params[i].detach()
        flat = self.full_values(slot.chunk) if c.world_size > 1 else c.storage.master[slot.chunk]
        return flat[slot.offset : slot.offset + slot.numel].to(c.device, c.dtype).view(c.params[i].shape)

    def note_read_by_graph(self, params: Iterable[torch.Tensor], graph: object = None) -> None:
        """A compiled graph (its key: `graph`) reads these parameters (it gathers the offloaded ones itself)."""
        index = self._chunks.index
        read = {index[id(p)] for p in params if id(p) in index}
        self.read_by_graphs.update(read)
        if read and graph is not None:
            self.graphs_reading.add(graph)

    def read_by_no_graph(self, indices: Sequence[int]) -> list[int]:
        """Those of these parameters that no compiled graph read in the first step (none before it is over)."""
        return [] if self._chunks.step_state.first else [i for i in indices if i not in self.read_by_graphs]

    def lend_to_python(self, indices: Sequence[int], *, for_backward: bool) -> None:
        """A compiled forward ends inside these parameters' modules, whose forward Python goes on with: those no
        compiled graph reads get their values (`lend`)."""
        self.lend([i for i in indices if i not in self.read_by_graphs], for_backward=for_backward)

    def lend(self, indices: Sequence[int], *, for_backward: bool) -> None:
        """A forward outside the compiled graphs is about to read these parameters: offloaded ones get their values
        (storage of their own again) until `take_back`, or the end of the step where the backward may read them.
        Where their gradients will come (`for_backward`), their chunks update in the step (`update_in_step`)."""
        c = self._chunks
        for i in indices:
            p = c.params[i]
            if for_backward and p.requires_grad:
                c.update_in_step(c.slots[i].chunk)
            if c.is_persistent(p):
                continue
            if i not in self.lent:
                values = self.param_values(i)
                p.untyped_storage().resize_(int((p.storage_offset() + p.numel()) * p.element_size()))
                with torch.no_grad(), as_plain():
                    p.copy_(values)
            self.lent[i] = self.lent.get(i, False) or (for_backward and p.requires_grad)

    def take_back(self, indices: Sequence[int] | None = None, *, all_of_them: bool = False) -> None:
        """Offloaded parameters lent for a forward give their storage back, but those the backward may still read
        (until the step's end, which takes back `all_of_them`)."""
        for i in list(self.lent if indices is None else indices):
            if i in self.lent and (all_of_them or not self.lent[i]):
                del self.lent[i]
                self._chunks.params[i].untyped_storage().resize_(0)

    def load_param(self, i: int, value: torch.Tensor) -> None:
        """Parameter `i` takes `value` (whole, parameter-shaped; model.load_state_dict): its master and compute
        copy, this rank's part where sharded. Its optimizer states stay, as torch's do."""
        c = self._chunks
        slot = c.slots[i]
        a, b = slot.offset, slot.offset + slot.numel
        c.wait_for_update(slot.chunk)
        c.join_early_updates()
        flat = value.detach().reshape(-1)
        lo, hi = (0, c.layout.chunk_elems) if not c.storage.is_sharded(slot.chunk) else c.storage.shard_bounds()
        s, e = max(a, lo), min(b, hi)
        if s < e:
            with torch.no_grad():
                c.storage.master[slot.chunk][s - lo : e - lo].copy_(flat[s - a : e - a])
        c.publish(slot.chunk)
        if i in self.lent:
            with torch.no_grad(), as_plain():
                c.params[i].copy_(value)

    def full_params(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Every parameter with its current values, whole, on the host in the compute dtype, fetched chunk by
        chunk: the host holds one chunk besides the values already handed out. A collective when sharded (every
        rank must exhaust it)."""
        c = self._chunks
        c.wait_for_update()
        for chunk in range(c.layout.n_chunk):
            flat = self.full_values(chunk)
            for p, slot in zip(c.params, c.slots):
                if slot.chunk == chunk:
                    yield p, flat[slot.offset : slot.offset + slot.numel].view(p.shape).clone()

    def full_values(self, chunk: int) -> torch.Tensor:
        """The chunk's current parameters, whole, on the host (a collective when sharded). A persistent chunk
        updated during this step's backward gives its new master, as an offloaded chunk does."""
        c = self._chunks
        if chunk < c.n_persist:
            if chunk in c.step_state.early:
                c.join_early_updates()
                return c.storage.master[chunk].to("cpu", c.dtype)
            return c.storage.flat[chunk].to("cpu")
        if c.world_size == 1:
            return c.storage.master[chunk].to("cpu", c.dtype, copy=True)
        out = torch.empty(c.layout.chunk_elems, dtype=c.dtype, device=c.device)
        with across_ranks(f"the all-gather of chunk {chunk}'s weights"):
            dist.all_gather_into_tensor(out, c.storage.master[chunk].to(c.device, c.dtype))
        return out.to("cpu")
