"""OutsideMixin: the model used outside the compiled graphs (runtime/model_hooks.py, state dicts, checkpoints).

Reads of the parameters' current values (`param_values`, `full_values`, `full_params`: collectives where a chunk
is sharded), writes into them (`load_param`; in-place writes into persistent parameters taken into their masters,
`_take_outside_writes`), and offloaded parameters lent storage of their own for a forward that Python runs
(`lend`, `take_back`).

State it owns: `read_by_graphs` (parameters some compiled graph reads), `graphs_reading` (which graphs: where more
than one does, a re-plan keeps the chunks where they are), `_lent` (offloaded parameters holding values
for a forward outside the graphs -> whether the backward may still read them), `_param_versions` (the persistent
parameters' versions as the runtime left them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from protrain_fx.distributed import across_ranks
from protrain_fx.runtime.chunks.param_class import as_plain


class OutsideMixin:
    """The model outside the compiled graphs (module docstring). Part of ChunkManager."""

    def _init_outside(self) -> None:
        self.read_by_graphs: set[int] = set()  # parameters some compiled graph reads (`note_read_by_graph`)
        self.graphs_reading: set[object] = set()  # the keys of the compiled graphs reading them (GraphRecord.key)
        self._lent: dict[int, bool] = {}  # offloaded parameters given their values for a forward outside the graphs

    def _persistent_versions(self) -> dict[int, int]:
        """The parameters of persistent chunks that are not their own master -> their version as the runtime left
        it, to take in what is written into them from outside (an in-place init, say: `_take_outside_writes`)."""
        return {i: p._version for i, p in enumerate(self.params) if not self.own_master and self.is_persistent(p)}

    def _take_outside_writes(self) -> None:
        """Parameters of a persistent chunk written in place from outside the runtime (`nn.init`, a user's
        `p.mul_(...)`: their version moved; the runtime writes their chunk, not them) take their masters with
        them, where the parameters are not their own master."""
        for i, version in self._param_versions.items():
            p = self.params[i]
            if p._version != version:
                slot = self.slots[i]
                a, b = self._slot_range(slot)
                self._join_early_updates()
                self.master[slot.chunk][a:b].copy_(p.detach().reshape(-1))
                self._param_versions[i] = p._version

    def param_values(self, i: int) -> torch.Tensor:
        """Parameter `i`'s current values, whole, in the compute dtype on the chunks' device (a collective where its
        chunk is sharded)."""
        slot = self.slots[i]
        a, b = self._slot_range(slot)
        self.wait_for_update(slot.chunk)
        if slot.chunk < self.n_persist:
            return self.params[i].detach()
        flat = self.full_values(slot.chunk) if self.world_size > 1 else self.master[slot.chunk]
        return flat[a:b].to(self.device, self.dtype).view(self.params[i].shape)

    def note_read_by_graph(self, params, graph: object = None) -> None:
        """A compiled graph (its key: `graph`) reads these parameters (it gathers the offloaded ones itself)."""
        read = {self.index[id(p)] for p in params if self.holds(p)}
        self.read_by_graphs.update(read)
        if read and graph is not None:
            self.graphs_reading.add(graph)

    def read_by_no_graph(self, indices: Sequence[int]) -> list[int]:
        """Those of these parameters that no compiled graph read in the first step (none before it is over)."""
        return [] if self.step_state.first else [i for i in indices if i not in self.read_by_graphs]

    def lend_to_python(self, indices: Sequence[int], *, for_backward: bool) -> None:
        """A compiled forward ends inside these parameters' modules, whose forward Python goes on with: those no
        compiled graph reads get their values (`lend`)."""
        self.lend([i for i in indices if i not in self.read_by_graphs], for_backward=for_backward)

    def lend(self, indices: Sequence[int], *, for_backward: bool) -> None:
        """A forward outside the compiled graphs is about to read these parameters: offloaded ones get their values
        (storage of their own again) until `take_back`, or the end of the step where the backward may read them.
        Where their gradients will come (`for_backward`), their chunks update in the step (`eager_chunks`)."""
        for i in indices:
            p = self.params[i]
            if for_backward and p.requires_grad:
                self.eager_chunks.add(self.slots[i].chunk)
            if self.is_persistent(p):
                continue
            if i not in self._lent:
                values = self.param_values(i)
                p.untyped_storage().resize_((p.storage_offset() + p.numel()) * p.element_size())
                with torch.no_grad(), as_plain():
                    p.copy_(values)
            self._lent[i] = self._lent.get(i, False) or (for_backward and p.requires_grad)

    def take_back(self, indices: Sequence[int] | None = None, *, all_of_them: bool = False) -> None:
        """Offloaded parameters lent for a forward give their storage back, but those the backward may still read
        (until `end_step`, which takes back `all_of_them`)."""
        for i in list(self._lent if indices is None else indices):
            if i in self._lent and (all_of_them or not self._lent[i]):
                del self._lent[i]
                self.params[i].untyped_storage().resize_(0)

    def load_param(self, i: int, value: torch.Tensor) -> None:
        """Parameter `i` takes `value` (whole, parameter-shaped; model.load_state_dict): its master and compute
        copy, this rank's part where sharded. Its optimizer states stay, as torch's do."""
        slot = self.slots[i]
        a, b = self._slot_range(slot)
        self.wait_for_update(slot.chunk)
        self._join_early_updates()
        flat = value.detach().reshape(-1)
        lo, hi = (0, self.layout.chunk_elems) if not self.is_sharded(slot.chunk) else self._shard_bounds()
        s, e = max(a, lo), min(b, hi)
        if s < e:
            with torch.no_grad():
                self.master[slot.chunk][s - lo : e - lo].copy_(flat[s - a : e - a])
        if slot.chunk < self.n_persist and self.own_master:
            self._version[slot.chunk] = self._version.get(slot.chunk, 0) + 1
        else:
            self.publish(slot.chunk)
        if i in self._lent:
            with torch.no_grad(), as_plain():
                self.params[i].copy_(value)

    def full_params(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Every parameter with its current values, whole, on the host in the compute dtype, fetched chunk by
        chunk: the host holds one chunk besides the values already handed out. A collective when sharded (every
        rank must exhaust it)."""
        self.wait_for_update()
        for chunk in range(self.layout.n_chunk):
            flat = self.full_values(chunk)
            for p, slot in zip(self.params, self.slots):
                if slot.chunk == chunk:
                    yield p, flat[slot.offset : slot.offset + slot.numel].view(p.shape).clone()

    def full_values(self, chunk: int) -> torch.Tensor:
        """The chunk's current parameters, whole, on the host (a collective when sharded). A persistent chunk
        updated during this step's backward gives its new master, as an offloaded chunk does."""
        if chunk < self.n_persist:
            if chunk in self.step_state.early:
                self._join_early_updates()
                return self.master[chunk].to("cpu", self.dtype)
            return self.flat[chunk].to("cpu")
        if self.world_size == 1:
            return self.master[chunk].to(self.dtype, copy=True)
        out = torch.empty(self.layout.chunk_elems, dtype=self.dtype, device=self.device)
        with across_ranks(f"the all-gather of chunk {chunk}'s weights"):
            dist.all_gather_into_tensor(out, self.master[chunk].to(self.device, self.dtype))
        return out.to("cpu")
