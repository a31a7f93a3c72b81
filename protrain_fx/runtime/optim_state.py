"""What protrain_fx.optim.AdamW (runtime/optim.py) keeps of its states and gives back: checkpoints in torch's AdamW
format (`state_dict`, `load_state_dict`, and the per-chunk states `protrain_fx.state_dict` reads and writes), and the
copy of a chunk's master and states an update keeps to undo itself when the step's clip applies (`_snapshot`,
`restore`).
"""

from __future__ import annotations

import torch
from torch import nn


class AdamWStates:
    """The states' side of `AdamW`, a base of it: what these read (`_inner`, `_plain`, `_loaded`, `_snapshots`, the
    inner optimizers) is built there."""

    def _snapshot(self, manager, chunk: int, inner: torch.optim.AdamW) -> None:
        """Copy what an update of the chunk's piece changes (its master, each view's AdamW states) into a buffer
        kept for the chunk (three elements of the master dtype per element, allocated once)."""
        master = manager.storage.master[chunk]
        n = master.numel()
        key = (id(manager), chunk)
        kept, _ = self._snapshots.get(key, (None, None))
        if kept is None or kept.numel() != 3 * n:
            kept = torch.empty(3 * n, dtype=master.dtype, device=master.device)
        kept[:n].copy_(master)
        steps: dict[torch.Tensor, torch.Tensor | None] = {}
        for view in (v for group in inner.param_groups for v in group["params"]):
            st = inner.state.get(view)
            if not st:
                steps[view] = None  # (never updated: restored by forgetting its state)
                continue
            for k, slot in _kept_states(kept, master, view).items():
                slot.copy_(st[k].reshape(-1))
            steps[view] = st["step"].clone()
        self._snapshots[key] = (kept, steps)

    def restore(self, manager, chunk: int) -> None:
        """Put back the master and AdamW states `_snapshot` kept before the chunk's last update."""
        if self._inner.get((id(manager), chunk)) is None:  # (this rank's piece is all padding: nothing changed)
            return
        kept, steps = self._snapshots[(id(manager), chunk)]
        master = manager.storage.master[chunk]
        n = master.numel()
        master.copy_(kept[:n])
        inner = self._inner[(id(manager), chunk)]
        for view, step in steps.items():
            if step is None:
                inner.state.pop(view, None)
                continue
            st = inner.state[view]
            for k, slot in _kept_states(kept, master, view).items():
                st[k].reshape(-1).copy_(slot)
            st["step"].copy_(step)

    def _inner_optimizers(self) -> list[torch.optim.AdamW]:
        return [o for o in [*self._inner.values(), self._plain] if o is not None]

    @torch.no_grad()
    def state_dict(self) -> dict:
        """torch's AdamW format: per parameter index `step`, `exp_avg`, `exp_avg_sq` (master dtype, parameter-shaped,
        on the CPU), and the param groups. A collective when chunks are sharded across ranks (every rank calls it
        and gets the whole state), gathered chunk by chunk."""
        managers = self._managers()
        for manager in managers:
            manager.wait_for_update()
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        state: dict[int, dict] = {}
        sharded = {(id(m), c) for m in managers for c in range(m.layout.n_chunk) if m.storage.is_sharded(c)}
        for key, inner in [*self._inner.items(), (None, self._plain)]:
            if inner is None or key in sharded:
                continue
            for group in inner.param_groups:
                for view in group["params"]:
                    st = inner.state.get(view)
                    if st:
                        p = inner.param_of[id(view)]
                        state[index[id(p)]] = _full_state(st, p)
        for manager in managers:
            for chunk in range(manager.layout.n_chunk):
                if manager.storage.is_sharded(chunk):
                    state.update(self._gathered_states(manager, chunk, index))
        for p in params:  # states loaded but not placed yet (no step since load_state_dict)
            if index[id(p)] not in state and id(p) in self._loaded:
                state[index[id(p)]] = self._loaded[id(p)]
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
            for g in self.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def live_states(
        self, manager=None, chunk: int | None = None, *, create: bool = True
    ) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """The states this rank steps, by parameter: of its piece of `manager`'s `chunk` (1-D: the piece's
        elements; device or host, where the piece steps), or, with no manager, of the parameters no manager owns
        (only if they have stepped already, unless `create`). States not created yet (no step so far) are
        created as zeros at step 0, as the first step would; so these tensors can be written into
        (`protrain_fx.load_state_dict`)."""
        if manager is not None:
            manager.wait_for_update(chunk)
            inner = self._inner_for(manager, chunk)
        else:
            inner = self._plain_inner() if create else self._plain
        out = {}
        for group in inner.param_groups if inner is not None else ():
            for view in group["params"]:
                st = inner.state[view]
                if not st:
                    st.update(
                        step=torch.zeros((), dtype=torch.float32, device=view.device),
                        exp_avg=torch.zeros_like(view),
                        exp_avg_sq=torch.zeros_like(view),
                    )
                out[inner.param_of[id(view)]] = st
        return out

    def load_hyperparameters(self, groups: list[dict]) -> None:
        """Take the param groups' settings (not their parameters) from a checkpoint's `param_groups`."""
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)
        ):
            raise ValueError(
                "loaded optimizer state has param groups of sizes "
                f"{[len(g['params']) for g in groups]}, this optimizer {[len(g['params']) for g in self.param_groups]}"
            )
        for mine, theirs in zip(self.param_groups, groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    def load_full_states(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Whole (parameter-shaped) states to place where each parameter steps, once its inner optimizer exists
        (for parameters whose chunks are not built yet)."""
        self._loaded.update({id(p): st for p, st in states.items()})
        for inner in self._inner_optimizers():
            self._place_loaded(inner)

    def _gathered_states(self, manager, chunk: int, index: dict[int, int]) -> dict[int, dict]:
        """The states of a sharded chunk's parameters, whole: every rank's shard of `exp_avg` and `exp_avg_sq`
        gathered (a collective; a rank whose shard never stepped contributes zeros and step 0)."""
        shard = manager.layout.shard_elems
        flat = {k: torch.zeros(shard) for k in ("exp_avg", "exp_avg_sq")}
        step = torch.zeros(1)
        inner = self._inner.get((id(manager), chunk))
        pieces = {i: (start, end) for i, start, end, _ in manager.storage.param_pieces(chunk)}
        for group in inner.param_groups if inner is not None else ():
            for view in group["params"]:
                st = inner.state.get(view)
                if st:
                    start, end = pieces[manager.index[id(inner.param_of[id(view)])]]
                    for k in flat:
                        flat[k][start:end] = st[k].cpu()
                    step = torch.maximum(step, st["step"].cpu().reshape(1))
        full = {k: manager.gather_shards(v) for k, v in flat.items()}
        step = manager.gather_shards(step).max()
        if not step:
            return {}
        out = {}
        for slot, p in zip(manager.slots, manager.params):
            if slot.chunk == chunk and id(p) in index:
                a, b = slot.offset, slot.offset + slot.numel
                out[index[id(p)]] = {
                    "step": step.clone(),
                    **{k: v[a:b].reshape(p.shape).clone() for k, v in full.items()},
                }
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from `state_dict()` (or from `torch.optim.AdamW.state_dict()` with the same param groups)."""
        groups = state_dict["param_groups"]
        self.load_hyperparameters(groups)
        by_index = {
            i: p for theirs, mine in zip(groups, self.param_groups) for i, p in zip(theirs["params"], mine["params"])
        }
        self._loaded = {}
        self.load_full_states({by_index[int(i)]: st for i, st in state_dict["state"].items()})

    def _place_loaded(self, inner: torch.optim.AdamW) -> None:
        """Put loaded states into an inner optimizer, on its views' devices."""
        for group in inner.param_groups:
            for view in group["params"]:
                st = self._loaded.pop(id(inner.param_of[id(view)]), None)
                if st is None:
                    continue
                begin, end = inner.range_of[id(view)]  # this rank's piece of the parameter
                inner.state[view] = {
                    "step": torch.as_tensor(st["step"], dtype=torch.float32).to(view.device).clone(),
                    **{
                        k: st[k].reshape(-1)[begin:end].reshape(view.shape).to(view.device, view.dtype).clone()
                        for k in ("exp_avg", "exp_avg_sq")
                    },
                }

    @torch.no_grad()
    def chunk_states(self, manager, chunk: int) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """The AdamW states of a chunk's parameters that have any, whole (parameter-shaped, on the CPU; a sharded
        chunk's gathered from every rank's pieces, a collective), for `ChunkPlacement.place_again`, which moves the
        chunk: its inner optimizer and kept snapshot are dropped (they view the storage it leaves)."""
        manager.wait_for_update(chunk)
        inner = self._inner.pop((id(manager), chunk), None)
        self._snapshots.pop((id(manager), chunk), None)
        if manager.storage.is_sharded(chunk):
            return _gathered_chunk_states(manager, chunk, inner)
        found = {}
        for view in (v for group in inner.param_groups for v in group["params"]) if inner is not None else ():
            st = inner.state.get(view)
            if st:
                found[inner.param_of[id(view)]] = _full_state(st, inner.param_of[id(view)])
        return found

    def adopt_chunk_states(self, manager, chunk: int, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """A moved chunk's states (`chunk_states`) where it steps now: its inner optimizer, over the chunk's new
        storage, built with them (this rank's pieces)."""
        self._loaded.update({id(p): st for p, st in states.items()})
        self._inner_for(manager, chunk)
        for p in states:  # (a parameter of which this rank holds no piece)
            self._loaded.pop(id(p), None)


def _kept_states(kept: torch.Tensor, master: torch.Tensor, view: torch.Tensor) -> dict[str, torch.Tensor]:
    """Where `AdamW._snapshot` keeps a view's AdamW states: `kept` holds the master, then each state laid out
    like the master."""
    n, at = master.numel(), view.storage_offset() - master.storage_offset()
    return {
        k: kept[(i + 1) * n + at : (i + 1) * n + at + view.numel()] for i, k in enumerate(("exp_avg", "exp_avg_sq"))
    }


def _full_state(st: dict, p: nn.Parameter) -> dict:
    return {
        "step": st["step"].detach().to("cpu", copy=True),
        "exp_avg": st["exp_avg"].detach().reshape(p.shape).to("cpu", copy=True),
        "exp_avg_sq": st["exp_avg_sq"].detach().reshape(p.shape).to("cpu", copy=True),
    }


def _gathered_chunk_states(manager, chunk: int, inner: torch.optim.AdamW | None) -> dict[nn.Parameter, dict]:
    """`AdamW.chunk_states` of a sharded chunk: every rank's pieces of each parameter's states gathered (a
    collective), each with its own step; a parameter no rank has a state of gets none."""
    indices = [i for i, slot in enumerate(manager.slots) if slot.chunk == chunk]
    flat = {k: torch.zeros(manager.layout.shard_elems, dtype=manager.master_dtype) for k in ("exp_avg", "exp_avg_sq")}
    steps = torch.full((len(indices),), -1.0)  # (-1: no state on this rank)
    pieces = {i: (start, end) for i, start, end, _ in manager.storage.param_pieces(chunk)}
    for view in (v for group in inner.param_groups for v in group["params"]) if inner is not None else ():
        st = inner.state.get(view)
        if st:
            i = manager.index[id(inner.param_of[id(view)])]
            start, end = pieces[i]
            for k in flat:
                flat[k][start:end] = st[k].reshape(-1).cpu()
            steps[indices.index(i)] = st["step"].cpu()
    full = {k: manager.gather_shards(v) for k, v in flat.items()}
    steps = manager.gather_shards(steps).view(manager.world_size, -1).amax(0)
    out = {}
    for k, i in enumerate(indices):
        if steps[k] >= 0:
            p, slot = manager.params[i], manager.slots[i]
            whole = {key: v[slot.offset : slot.offset + slot.numel].view(p.shape).clone() for key, v in full.items()}
            out[p] = {"step": steps[k].clone(), **whole}
    return out


def _full_state(st: dict, p: nn.Parameter) -> dict:
    return {
        "step": st["step"].detach().to("cpu", copy=True),
        "exp_avg": st["exp_avg"].detach().reshape(p.shape).to("cpu", copy=True),
        "exp_avg_sq": st["exp_avg_sq"].detach().reshape(p.shape).to("cpu", copy=True),
    }
