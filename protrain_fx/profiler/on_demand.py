"""Profiling a model or batch larger than the GPU (paper §3.2): tensors held only while they are used.

A profiling iteration with `OnDemand` keeps on the device only what the node being run needs:
- offloaded chunk parameters (a `protrain_fx.prepare`d model) are brought in from the chunks just before their
  first use in a graph and dropped after their last one, in the backward again;
- activations the forward saves for the backward are dropped after their last forward use and brought back,
  zero-filled, just before the backward first reads them (the values do not matter to a profile: the nodes
  run the same kernels on them, and zero is a valid value of every dtype, indices included). A random
  generator's state saved for a recompute (`run_and_save_rng_state`: a model that checkpoints its own layers
  with dropout) is held: the backward loads it into the generator, which rejects zeros. Views made only
  for the backward, which AOTAutograd puts at the end of the forward, do not count as uses: what they view is
  brought back for them and dropped again;
- the backward's gradients are dropped once nothing in the graph reads them any more.

Memory is still reported as a run that holds all of those would see it: the trackers add `absent`, the
bytes dropped that such a run holds at that point, to what the allocator counts. So the profile, and the
cost models reading it, are the same whether a tensor was held or not (paper: "their fixed and predictable
sizes allow their contributions to peak memory to be reconstructed through static analysis").

A tensor is dropped by resizing its storage to 0 bytes and brought back by resizing it again: every view of
it stays valid. A storage's last use is the highest index of a node reading any value on it, learned as the
values appear (views extend it), so no alias analysis of the graph is needed.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._prims.rng_prims import run_and_save_rng_state
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from protrain_fx.profiler.memory import call_if_alive

CALL_OPS = ("call_function", "call_method", "call_module")  # the nodes that run an op
# chunks whose whole values a profile keeps on the host at once: reading one is a host copy (a collective when
# sharded), and the nodes of a block whose parameters lie in two chunks read them in turn
HELD_CHUNKS = 2


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage, stable across views and resizes."""
    return t.untyped_storage()._cdata


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.device.type != "meta"]


class OnDemand:
    """What one profiling iteration holds on demand (see the module docstring).

    `manager`, `params`: the chunk manager of a prepared model and the graph's parameters; its offloaded
    ones are fetched from the chunks. Without a manager only activations and gradients are dropped.
    """

    def __init__(self, manager=None, params: Sequence[nn.Parameter] = ()):
        self.manager = manager
        offloaded = [p for p in params if manager is not None and manager.holds_no_values(p)]
        self.params: dict[int, nn.Parameter] = {storage_key(p): p for p in offloaded}
        self.sizes: dict[int, int] = {k: p.numel() * p.element_size() for k, p in self.params.items()}
        self.dropped: dict[int, torch.Tensor] = {}  # storage -> a tensor on it, while it holds 0 bytes
        self.absent = 0  # bytes dropped that a run holding everything holds now
        self.tracker = None
        # chunk -> its whole values on the host, the last HELD_CHUNKS read (a block's parameters can lie in two
        # chunks, which its nodes then read in turn)
        self._chunk_values: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._learned: dict[int, GraphRun] = {}  # id of a graph -> its last run's hooks
        for key, p in self.params.items():
            assert p.untyped_storage().nbytes() == 0, f"offloaded parameter {p.shape} still holds its values"
            self.dropped[key] = p
            self.absent += self.sizes[key]

    def graph_run(self, gm: fx.GraphModule, *, drop: frozenset[str], tracker=None) -> GraphRun:
        """The hooks of one run of `gm`; `drop`: names of the nodes whose values are dropped after their last
        use (the forward's saved activations, the backward's gradients). What it does is kept for `replay`."""
        self.tracker = tracker
        self._learned[id(gm)] = run = GraphRun(self, gm, drop)
        return run

    def replay(self, gm: fx.GraphModule) -> Replay:
        """What the last `graph_run` of `gm` did, to repeat in a timed run."""
        assert id(gm) in self._learned, f"graph {gm.__class__.__name__} is replayed before it was run on demand"
        self.tracker = None
        return Replay(self, self._learned[id(gm)])

    def fetch(self, key: int) -> bool:
        """Bring a dropped storage back; True if a chunk's values were read from the host for it (CPU work, and a
        synchronous copy where the chunk is on the device, during which the GPU's queue runs dry)."""
        t = self.dropped.pop(key)
        nbytes = self.sizes[key] if key in self.params else self.sizes.pop(key)  # a storage's key outlives it
        t.untyped_storage().resize_(nbytes)
        self.absent -= nbytes
        read = False
        # the host copy and the views taken here are not the graph's memory: the CPU tracker counts `t` alone
        with torch.no_grad(), _disable_current_modes():
            if key in self.params:
                slot = self.manager.slot_of(t)
                read = slot.chunk not in self._chunk_values
                if read:
                    while len(self._chunk_values) >= HELD_CHUNKS:
                        self._chunk_values.popitem(last=False)  # (before the next chunk's copy is made)
                    values = self.manager.outside.full_values(slot.chunk)
                    # pinned, so that each parameter's copy queues behind the GPU's work instead of waiting for it
                    self._chunk_values[slot.chunk] = values.pin_memory() if t.is_cuda else values
                self._chunk_values.move_to_end(slot.chunk)
                source = self._chunk_values[slot.chunk][slot.offset : slot.offset + slot.numel].view(t.shape)
                # (the chunk's own values, not a write for the chunk to take in: its class's Python calls are off)
                with torch._C.DisableTorchFunctionSubclass():
                    t.copy_(source, non_blocking=t.is_cuda)
            else:
                _bytes_of(t).zero_()
        if self.tracker is not None:
            self.tracker.track([t])
        return read

    def drop(self, key: int, t: torch.Tensor) -> None:
        """Free a storage's bytes; `absent` holds them while a full run would."""
        storage = t.untyped_storage()
        self.sizes.setdefault(key, storage.nbytes())
        if self.tracker is not None:
            self.tracker.forget(storage)
        storage.resize_(0)
        self.dropped[key] = self.params.get(key, t)  # a parameter is fetched by its own slot
        self.absent += self.sizes[key]

    def end_iteration(self) -> None:
        """After the backward: dropped activations the backward never read are gone in a full run too, and every
        parameter is dropped again (the runtime expects offloaded parameters to hold no bytes), and the chunks' host
        copies go (pinned: the host budget after the profile counts them free)."""
        self.tracker = None
        self._chunk_values.clear()
        for key in [k for k in self.dropped if k not in self.params]:
            self.dropped.pop(key)
            self.absent -= self.sizes.pop(key)
        for key, p in self.params.items():
            if key not in self.dropped:
                self.drop(key, p)


class AbsentCounting:
    """A memory tracker (profiler/memory.py) that adds what `on_demand` dropped (`absent`) to every reading;
    `measured_peak` is the highest the wrapped tracker itself saw."""

    def __init__(self, tracker, on_demand: OnDemand):
        self.inner, self.on_demand = tracker, on_demand
        self.measured_peak = 0

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def track(self, tensors) -> None:
        self.inner.track(tensors)

    def forget(self, storage) -> None:
        self.inner.forget(storage)

    def allocated(self) -> int:
        return self.inner.allocated() + self.on_demand.absent

    def peak(self) -> int:
        peak = self.inner.peak()
        self.measured_peak = max(self.measured_peak, peak)
        return peak + self.on_demand.absent

    def reset_peak(self) -> None:
        self.inner.reset_peak()


def _is_rng_state(node: fx.Node) -> bool:
    """The generator state `run_and_save_rng_state` saves for a recompute: its values matter (module docstring)."""
    producer = node.args[0] if node.target is operator.getitem else None
    return getattr(producer, "target", None) is run_and_save_rng_state and node.args[1] == 0


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `t`."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class GraphRun:
    """Hooks around the call nodes of one graph run (numbered in graph order), called by the memory run
    (profiler/interpreter.py: ProfilingInterpreter): `start(args)` once, then per node `before(i)` (fetch what
    node i reads) and `after(i, value)` (learn its storages, drop what is done). What it did is kept as
    `fetch_before` and `drop_after` for `Replay`."""

    def __init__(self, on_demand: OnDemand, gm: fx.GraphModule, drop: frozenset[str]):
        self.on_demand = on_demand
        self.nodes = [n for n in gm.graph.nodes if n.op in CALL_OPS]
        index = {n: i for i, n in enumerate(self.nodes)}
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # the views that end the graph and only make outputs: AOTAutograd's partitioner puts those of the saved
        # values at the end of the forward, where they would hold every storage they view until then. They do not
        # count as reads (what they view is dropped after its last other read) and bring what they view back just
        # before they run
        late: set[fx.Node] = set()
        for n in reversed(self.nodes):
            if not (getattr(n.target, "is_view", False) and all(u.op == "output" or u in late for u in n.users)):
                break
            late.add(n)
        self.late_views = {index[n] for n in late}
        self.late_read = {a.name for n in late for a in n.all_input_nodes if a not in late}
        # the call nodes reading each node's value, by index
        self.users = {n: sorted(index[u] for u in n.users if u in index and u not in late) for n in gm.graph.nodes}
        self.drop_names = drop
        self.last_use: dict[int, int] = {}  # storage -> highest index of a node reading it
        self.first_use: dict[int, list[int]] = {}  # node index -> dropped storages it needs back first
        self.droppable: dict[int, torch.Tensor] = {}  # storage -> a tensor on it, to drop after its last use
        self._inputs: set[int] = set()
        # what this run did, by node name and tensor leaf, for later runs to repeat without learning it again
        self._source: dict[int, tuple[str, int]] = {}  # storage -> the first (node, leaf) seen on it
        self.fetch_before: dict[int, list[tuple[str, int]]] = {}
        self.drop_after: dict[int, list[tuple[str, int]]] = {}

    def _seen(self, key: int, node: fx.Node, leaf: int, t: torch.Tensor) -> None:
        if key not in self._source:
            self._source[key] = (node.name, leaf)
            # a storage freed during the run leaves its key to the next one allocated where it was: what is known
            # of it goes with it (else a later storage would be dropped late, and the timed run would drop the
            # freed one's value, held alive for it, instead of its own; or, on a freed input's key, never)
            # (through a weak method: the finalizer registry is global, and a storage that outlives the run, one
            # the manager holds, would otherwise hold the run, and through it the manager, for ever)
            weakref.finalize(t.untyped_storage(), call_if_alive, weakref.WeakMethod(self._freed), key)

    def _freed(self, key: int) -> None:
        self._source.pop(key, None)
        self.last_use.pop(key, None)
        self._inputs.discard(key)

    def _read_by(self, key: int, node: fx.Node, produced_at: int) -> None:
        users = self.users[node]
        self.last_use[key] = max(self.last_use.get(key, produced_at), users[-1] if users else produced_at)

    def start(self, args: Sequence[Any]) -> None:
        dropped = self.on_demand.dropped
        for node, value in zip(self.placeholders, args):
            for leaf, t in enumerate(_tensors(value)):
                key = storage_key(t)
                self._inputs.add(key)
                self._seen(key, node, leaf, t)
                self._read_by(key, node, -1)
                if key in dropped and self.users[node]:
                    self.first_use.setdefault(self.users[node][0], []).append(key)
                    self.fetch_before.setdefault(self.users[node][0], []).append((node.name, leaf))
                    if key in self.on_demand.params:  # dropped again after its last use in this graph
                        self.droppable[key] = t

    def before(self, i: int, env: dict[fx.Node, Any]) -> None:
        """`env`: the interpreter's values so far, by node (node i's inputs among them)."""
        for key in self.first_use.pop(i, ()):
            if key in self.on_demand.dropped:
                self.on_demand.fetch(key)
        if i not in self.late_views:
            return
        for node in self.nodes[i].all_input_nodes:
            for leaf, t in enumerate(_tensors(env.get(node))):
                key = storage_key(t)
                if key in self.on_demand.dropped:
                    self.on_demand.fetch(key)
                    self.fetch_before.setdefault(i, []).append((node.name, leaf))
                    self.droppable[key] = t  # dropped again after the view (no later read counts)

    def after(self, i: int, value: Any) -> None:
        node = self.nodes[i]
        for leaf, t in enumerate(_tensors(value)):
            key = storage_key(t)
            self._seen(key, node, leaf, t)
            self._read_by(key, node, i)
            if (
                (node.name in self.drop_names or node.name in self.late_read)
                and not _is_rng_state(node)
                and key not in self._inputs
                and key not in self.on_demand.params
                and t.untyped_storage().resizable()
            ):
                self.droppable[key] = t
        for key in [k for k in self.droppable if self.last_use[k] <= i]:
            self.on_demand.drop(key, self.droppable.pop(key))
            self.drop_after.setdefault(i, []).append(self._source[key])


class Replay:
    """A learned `GraphRun` repeated by a timed copy of the graph (profiler/timed.py: TimedGraph), which
    passes the values named by `fetch_before` and `drop_after` to `between` (no per-node bookkeeping, which
    would slow the CPU's kernel launches and so the times measured)."""

    def __init__(self, on_demand: OnDemand, learned: GraphRun):
        self.on_demand = on_demand
        self.fetch_before, self.drop_after = learned.fetch_before, learned.drop_after

    def between(self, drops: tuple[tuple[Any, int], ...], fetches: tuple[tuple[Any, int], ...]) -> bool:
        """Drop then fetch storages given as (value, tensor leaf); True if a chunk was read from the host."""
        on_demand, fetched = self.on_demand, False
        for value, leaf in drops:
            t = _tensors(value)[leaf]
            key = storage_key(t)
            if key not in on_demand.dropped:
                on_demand.drop(key, t)
        for value, leaf in fetches:
            key = storage_key(_tensors(value)[leaf])
            if key in on_demand.dropped:
                fetched |= on_demand.fetch(key)
        return fetched
