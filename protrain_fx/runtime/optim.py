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
the next backward on.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

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
        self._inner: dict[tuple[int, int], torch.optim.AdamW] = {}
        self._plain: torch.optim.AdamW | None = None
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
        for i, start, end in manager.param_pieces(chunk):
            view = master[start:end]
            view.grad = grad[start:end]
            groups.setdefault(index[id(manager.params[i])], []).append(view)
        if not groups:
            return None
        inner = torch.optim.AdamW(
            [{"params": views, **{k: self.param_groups[g][k] for k in _HYPER}} for g, views in groups.items()],
            fused=True,
        )
        inner.outer_groups = list(groups)
        return inner

    @torch.no_grad()
    def step_chunk(self, manager, chunk: int) -> None:
        """Update one chunk piece (the manager calls this on its worker thread for offloaded chunks)."""
        inner = self._inner_for(manager, chunk)
        if inner is not None:
            for group, g in zip(inner.param_groups, inner.outer_groups):
                group.update({k: self.param_groups[g][k] for k in _HYPER})
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
                if chunk in manager.has_grad:  # like torch's AdamW, a parameter without gradient is not updated
                    self.step_chunk(manager, chunk)
        self._step_plain()
        return loss

    def _step_plain(self) -> None:
        """Parameters no manager owns: a torch AdamW over them, kept in step with the param groups."""
        groups = [[p for p in g["params"] if MANAGER_ATTR not in p.__dict__] for g in self.param_groups]
        if not any(groups):
            return
        if self._plain is None:
            self._plain = torch.optim.AdamW(
                [{"params": ps, **{k: g[k] for k in _HYPER}} for ps, g in zip(groups, self.param_groups) if ps],
                fused=all(p.device.type in ("cuda", "cpu") for ps in groups for p in ps),
            )
            self._plain.outer_groups = [i for i, ps in enumerate(groups) if ps]
        for group, g in zip(self._plain.param_groups, self._plain.outer_groups):
            group.update({k: self.param_groups[g][k] for k in _HYPER})
        self._plain.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for manager in self._managers():
            manager.wait_for_update()
            manager.zero_grad()
