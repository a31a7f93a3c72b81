"""Pretrained weights for `protrain_fx.prepare(model, weights=path)`: a Hugging Face checkpoint on disk in safetensors
(`model.safetensors`, or shards listed by `model.safetensors.index.json`), read one tensor at a time as `prepare`
fills each module, so the host never holds more of the checkpoint than the tensor being copied."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsWeights:
    """The tensors of a safetensors checkpoint by name; `fill` copies them into a module's own tensors."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            index = path / INDEX_FILE
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {name: path / file for name, file in weight_map.items()}
            elif (path / SINGLE_FILE).is_file():
                self.files = self._names_in(path / SINGLE_FILE)
            else:
                raise ValueError(
                    f"prepare(weights={str(path)!r}): the folder has neither {INDEX_FILE} nor {SINGLE_FILE}"
                )
        elif path.is_file() and path.suffix == ".safetensors":
            self.files = self._names_in(path)
        else:
            raise ValueError(
                f"prepare(weights={str(path)!r}): pass a folder saved by save_pretrained (safetensors) or a "
                ".safetensors file"
            )
        self.used: set[str] = set()

    @staticmethod
    def _names_in(file: Path) -> dict[str, Path]:
        with safe_open(file, framework="pt") as f:
            return dict.fromkeys(f.keys(), file)

    def _read(self, name: str) -> torch.Tensor:
        """One tensor, its file mapped only while it is read (mapped pages count as the process's memory)."""
        self.used.add(name)
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name)

    def fill(self, tensors: list[tuple[str, torch.Tensor]], names: dict[int, list[str]]) -> None:
        """Copy the checkpoint's values into `tensors` ((qualified name, tensor) pairs), each found under any of its
        names (`names`: id -> every qualified name of a tied tensor); those it lacks keep their values."""
        for qualified, t in tensors:
            found = next((n for n in names.get(id(t), [qualified]) if n in self.files), None)
            if found is None:
                continue
            value = self._read(found)
            if value.shape != t.shape:
                raise ValueError(
                    f"prepare(weights=...): the checkpoint's {found!r} has shape {tuple(value.shape)}, the model's "
                    f"{qualified!r} {tuple(t.shape)}: the checkpoint is of another model or configuration"
                )
            with torch.no_grad():
                t.copy_(value)

    def close(self) -> None:
        unused = len(self.files) - len(self.used)
        if unused:
            log.warning("prepare(weights=...): %d tensors of the checkpoint are not in the model", unused)


class ModuleFiller:
    """What `prepare` calls on each module before its tensors go into chunks or to the device: a meta module's own
    tensors are allocated (parameters keep their identity), then filled by the user's `init(module)` and the
    checkpoint's values (`weights`), in that order. Allocated on `device` where `init` runs (it then runs at the
    device's speed: a CPU fills a 5B model's random weights in minutes), else on the CPU, where the checkpoint's
    values are read. Checks up front that every tensor gets a value."""

    def __init__(self, model: nn.Module, init, weights: str | Path | None, device: torch.device):
        self.init = init
        self.device = device if init is not None else torch.device("cpu")
        self.checkpoint = SafetensorsWeights(weights) if weights is not None else None
        self.names: dict[int, list[str]] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.names.setdefault(id(t), []).append(name)
        self.prefix = {id(m): f"{name}." if name else "" for name, m in model.named_modules()}
        self.done: set[int] = set()  # modules
        self.filled: set[int] = set()  # tensors given the checkpoint's values
        self._check(model)

    def _check(self, model: nn.Module) -> None:
        known = self.checkpoint.files if self.checkpoint is not None else {}
        lacking = [
            (name, t)
            for name, t in [*model.named_parameters(), *model.named_buffers()]
            if not any(n in known for n in self.names[id(t)])
        ]
        meta = [n for n, t in lacking if t.is_meta]
        if meta and self.init is None:
            where = "the checkpoint has no values for them" if self.checkpoint is not None else "nothing fills them"
            raise ValueError(
                f"{len(meta)} parameters and buffers of the model are on the meta device and {where} (e.g. "
                f"{meta[0]!r}); pass init=fn, where fn(module) fills a module's own parameters and buffers after "
                "they are allocated (or build the model with accelerate's init_empty_weights(include_buffers=False), "
                "so that buffers are real, and call model.tie_weights() after it: it unties a head from its embedding)"
            )
        params = [n for n, t in lacking if isinstance(t, nn.Parameter)]
        if self.checkpoint is not None and params and self.init is None:
            raise ValueError(
                f"the checkpoint has no values for {len(params)} parameters of the model (e.g. {params[0]!r}): it is "
                "of another model, or pass init=fn to fill what it lacks"
            )

    def __call__(self, module: nn.Module) -> None:
        if id(module) in self.done:
            return
        self.done.add(id(module))
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        meta = any(t.is_meta for t in own)
        if not meta and self.checkpoint is None:
            return
        for p in module.parameters(recurse=False):
            if p.is_meta:
                real = nn.Parameter(torch.empty_like(p, device=self.device), requires_grad=p.requires_grad)
                real.__dict__.update(p.__dict__)
                torch.utils.swap_tensors(p, real)
        for name, b in module.named_buffers(recurse=False):
            if b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=self.device)
                self.names[id(module._buffers[name])] = self.names.pop(id(b), [f"{self.prefix[id(module)]}{name}"])
        with torch.no_grad():
            if meta and self.init is not None:
                self.init(module)
        if self.checkpoint is not None:  # (a tied tensor once: another module holding it may be in chunks by now)
            prefix = self.prefix[id(module)]
            mine = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            todo = [(f"{prefix}{n}", t) for n, t in mine if id(t) not in self.filled]
            self.filled.update(id(t) for _, t in todo)
            self.checkpoint.fill(todo, self.names)

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()
