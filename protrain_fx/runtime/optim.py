"""protrain_fx.optim.AdamW: the optimizer of a model whose states live in chunks (runtime/chunks.py).

A `torch.optim.Optimizer` over the model's parameters, with the usual param groups, hyperparameters and
LR schedulers. The update itself is torch's fused AdamW (`torch.optim.AdamW(fused=True)`), run on views
of the chunks: one inner optimizer per chunk piece, whose parameters are views of the fp32 master and
whose gradients are views of the chunk's fp32 gradient, grouped like the outer param groups.

- Offloaded chunks: the manager starts the CPU step of each chunk on its worker thread as soon as the
  chunk's gradient is on the host, overlapping the rest of the backward; `step()` waits for them.
- Persistent chunks: `step()` runs their update on the GPU.
- Parameters no manager owns (the model was not compiled with protrain) are updated like
  `torch.optim.AdamW` would, from `param.grad`.
Hyperparameters are read from the param groups when a chunk steps, so a scheduler's change applies from
the next backward on. `state_dict()` / `load_state_dict()` use torch's AdamW format (per parameter `step`,
`exp_avg`, `exp_avg_sq`); loaded states are placed when the inner optimizers are built.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from protrain_fx.runtime.chunks import MANAGER_ATTR

OPTIMIZER_ATTR = "_protrain_optimizer"  # set on each parameter: a weak reference to its AdamW
_HYPER = ("lr", "betas", "eps", "weight_decay")


class AdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"AdamW got lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}; "
                "lr, eps and weight_decay must be >= 0 and betas in [0, 1)"
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._inner: dict[tuple[int, int], torch.optim.AdamW | None] = {}
        self._plain: torch.optim.AdamW | None = None
        self._loaded: dict[int, dict] = {}  # id(param) -> state from load_state_dict, not yet placed
        self._lock = threading.Lock()
        me = weakref.ref(self)
        for group in self.param_groups:
            for p in group["params"]:
                p.__dict__[OPTIMIZER_ATTR] = me

    def _group_index(self) -> dict[int, int]:
        return {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}

    def _managers(self) -> list:
        seen: dict[int, object] = {}
        for group in self.param_groups:
            for p in group["params"]:
                m = p.__dict__.get(MANAGER_ATTR)
                if m is not None:
                    seen[id(m)] = m
        return list(seen.values())

    def _inner_for(self, manager, chunk: int) -> torch.optim.AdamW | None:
        """None when this rank's piece of the chunk is all padding."""
        key = (id(manager), chunk)
        with self._lock:
            if key not in self._inner:
                self._inner[key] = self._build_inner(manager, chunk)
            return self._inner[key]

    def _build_inner(self, manager, chunk: int) -> torch.optim.AdamW | None:
        groups: dict[int, list[torch.Tensor]] = {}
        index = self._group_index()
        master, grad = manager.master[chunk], manager.grad[chunk]
        pieces = manager.param_pieces(chunk)
        views_in_order = []
        for i, start, end in pieces:
            view = master[start:end]
            view.grad = grad[start:end]
            groups.setdefault(index[id(manager.params[i])], []).append(view)
            views_in_order.append(view)
        if not groups:
            return None
        inner = self._make_inner(groups, {id(v): manager.params[i] for v, (i, _, _) in zip(views_in_order, pieces)})
        inner.grad_of = {id(v): v.grad for v in views_in_order}
        return inner

    def _make_inner(
        self, groups: dict[int, list[torch.Tensor]], param_of: dict[int, nn.Parameter]
    ) -> torch.optim.AdamW:
        """A fused torch AdamW over `groups` (outer group index -> tensors), with any loaded state placed."""
        inner = torch.optim.AdamW(
            [{"params": tensors, **{k: self.param_groups[g][k] for k in _HYPER}} for g, tensors in groups.items()],
            fused=True,
        )
        inner.outer_groups = list(groups)
        inner.param_of = param_of
        self._place_loaded(inner)
        return inner

    def _sync_hyper(self, inner: torch.optim.AdamW) -> None:
        """Copy the outer groups' hyperparameters (changed by schedulers) into an inner optimizer."""
        for group, g in zip(inner.param_groups, inner.outer_groups):
            group.update({k: self.param_groups[g][k] for k in _HYPER})

    @torch.no_grad()
    def step_chunk(self, manager, chunk: int) -> None:
        """Update one chunk piece (the manager calls this on its worker thread for offloaded chunks)."""
        inner = self._inner_for(manager, chunk)
        if inner is not None:
            self._sync_hyper(inner)
            for group in inner.param_groups:
                for view in group["params"]:  # like torch's AdamW, a parameter without gradient is not updated
                    got_grad = manager.index[id(inner.param_of[id(view)])] in manager.params_with_grad
                    view.grad = inner.grad_of[id(view)] if got_grad else None
            inner.step()
        manager.publish(chunk)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for manager in self._managers():
            if manager.optimizer is not self:
                manager.optimizer = self
            manager.wait_for_update()
            for chunk in manager.take_unstepped():  # gradients that arrived before the optimizer was known
                self.step_chunk(manager, chunk)
            for chunk in range(manager.n_persist):
                if chunk in manager.has_grad:
                    self.step_chunk(manager, chunk)
        self._step_plain()
        return loss

    def _step_plain(self) -> None:
        """Parameters no manager owns: a torch AdamW over them, kept in step with the param groups."""
        if self._plain is None:
            groups = {
                i: [p for p in g["params"] if MANAGER_ATTR not in p.__dict__] for i, g in enumerate(self.param_groups)
            }
            groups = {i: ps for i, ps in groups.items() if ps}
            if not groups:
                return
            self._plain = self._make_inner(groups, {id(p): p for ps in groups.values() for p in ps})
        self._sync_hyper(self._plain)
        self._plain.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for manager in self._managers():
            manager.wait_for_update()
            manager.zero_grad()

    # ----- state_dict ---------------------------------------------------------------------------------

    def _inner_optimizers(self) -> list[torch.optim.AdamW]:
        return [o for o in [*self._inner.values(), self._plain] if o is not None]

    @torch.no_grad()
    def state_dict(self) -> dict:
        """torch's AdamW format: per parameter index `step`, `exp_avg`, `exp_avg_sq` (fp32, parameter-shaped, on
        the CPU), and the param groups. One process only for now: with ranks, a parameter's states are split
        across them."""
        managers = self._managers()
        if any(m.world_size > 1 for m in managers):
            raise ValueError(
                "AdamW.state_dict() of a model sharded across ranks is not supported yet: every rank holds only "
                "its shard of the optimizer states"
            )
        for manager in managers:
            manager.wait_for_update()
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        state: dict[int, dict] = {}
        for inner in self._inner_optimizers():
            for group in inner.param_groups:
                for view in group["params"]:
                    st = inner.state.get(view)
                    if not st:
                        continue
                    p = inner.param_of[id(view)]
                    state[index[id(p)]] = {
                        "step": st["step"].detach().to("cpu", copy=True),
                        "exp_avg": st["exp_avg"].detach().reshape(p.shape).to("cpu", copy=True),
                        "exp_avg_sq": st["exp_avg_sq"].detach().reshape(p.shape).to("cpu", copy=True),
                    }
        for p in params:  # states loaded but not placed yet (no step since load_state_dict)
            if index[id(p)] not in state and id(p) in self._loaded:
                state[index[id(p)]] = self._loaded[id(p)]
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
            for g in self.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from `state_dict()` (or from `torch.optim.AdamW.state_dict()` with the same param groups)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)
        ):
            raise ValueError(
                "loaded optimizer state has param groups of sizes "
                f"{[len(g['params']) for g in groups]}, this optimizer {[len(g['params']) for g in self.param_groups]}"
            )
        for mine, theirs in zip(self.param_groups, groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        by_index = {
            i: p for theirs, mine in zip(groups, self.param_groups) for i, p in zip(theirs["params"], mine["params"])
        }
        self._loaded = {id(by_index[int(i)]): st for i, st in state_dict["state"].items()}
        for inner in self._inner_optimizers():
            self._place_loaded(inner)

    def _place_loaded(self, inner: torch.optim.AdamW) -> None:
        """Put loaded states into an inner optimizer, on its views' devices."""
        for group in inner.param_groups:
            for view in group["params"]:
                st = self._loaded.pop(id(inner.param_of[id(view)]), None)
                if st is None:
                    continue
                inner.state[view] = {
                    "step": torch.as_tensor(st["step"], dtype=torch.float32).to(view.device).clone(),
                    "exp_avg": st["exp_avg"].reshape(view.shape).to(view.device, torch.float32).clone(),
                    "exp_avg_sq": st["exp_avg_sq"].reshape(view.shape).to(view.device, torch.float32).clone(),
                }
