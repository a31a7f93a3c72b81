"""Pretrained weights for `protrain_fx.prepare(model, weights=path)`: a checkpoint on disk in safetensors
(`model.safetensors`, or shards listed by `model.safetensors.index.json`), read one tensor at a time as `prepare`
fills each module, so the host never holds more of the checkpoint than the tensors one model tensor is made from.
A Hugging Face model (a transformers `PreTrainedModel`) takes it by transformers' own rules (`pretrained.py`: key
renames and conversions, base-model prefixes, ties, missing tensors, dtype, the report of keys); any other module by
its tensors' names."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from protrain_fx.runtime.pretrained import PretrainedCheckpoint, is_hugging_face_model

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsWeights:
    """The tensors of a safetensors checkpoint by name: their shapes and dtypes from the files' headers, their
    values read one at a time. `value` is the rule for a module that is not a Hugging Face model: a tensor's value is
    the checkpoint's of the same name."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.index_metadata: dict | None = None  # (a sharded checkpoint's index: its "metadata")
        if path.is_dir():
            self.folder: Path | None = path
            index = path / INDEX_FILE
            if index.is_file():
                content = json.loads(index.read_text())
                self.files = {name: path / file for name, file in content["weight_map"].items()}
                self.index_metadata = content.get("metadata") or {}
            elif (path / SINGLE_FILE).is_file():
                self.files = self._names_in(path / SINGLE_FILE)
            else:
                raise ValueError(
                    f"prepare(weights={str(path)!r}): the folder has neither {INDEX_FILE} nor {SINGLE_FILE}"
                )
        elif path.is_file() and path.suffix == ".safetensors":
            self.folder = path.parent
            self.files = self._names_in(path)
        else:
            raise ValueError(
                f"prepare(weights={str(path)!r}): pass a folder saved by save_pretrained (safetensors) or a "
                ".safetensors file"
            )
        self.used: set[str] = set()
        self._headers: dict[Path, dict[str, torch.Tensor]] = {}

    @staticmethod
    def _names_in(file: Path) -> dict[str, Path]:
        with safe_open(file, framework="pt") as f:
            return dict.fromkeys(f.keys(), file)

    def header_tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` on the meta device: its shape and dtype from its file's header, nothing read."""
        from transformers.modeling_utils import load_state_dict

        file = self.files[name]
        if file not in self._headers:
            self._headers[file] = load_state_dict(str(file), map_location="meta")
        return self._headers[file][name]

    def read(self, name: str) -> torch.Tensor:
        """One tensor, its file mapped only while it is read (mapped pages count as the process's memory)."""
        self.used.add(name)
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name)

    def value(self, names: list[str], like: torch.Tensor) -> torch.Tensor | None:
        """The value of the model tensor `like`, known by `names` (a tied tensor has several): the checkpoint's
        under the first of them it has, else None."""
        found = next((n for n in names if n in self.files), None)
        if found is None:
            return None
        value = self.read(found)
        if value.shape != like.shape:
            raise ValueError(
                f"prepare(weights=...): the checkpoint's {found!r} has shape {tuple(value.shape)}, the model's "
                f"{names[0]!r} {tuple(like.shape)}: the checkpoint is of another model or configuration"
            )
        return value

    def close(self) -> None:
        unused = len(self.files) - len(self.used)
        if unused:
            log.warning("prepare(weights=...): %d tensors of the checkpoint are not in the model", unused)


class ModuleFiller:
    """What `prepare` calls on each module before its tensors go into chunks or to the device: a meta module's own
    tensors are allocated (parameters keep their identity), then filled by the user's `init(module)` and the
    checkpoint's values (`weights`), in that order; in a Hugging Face model, what the checkpoint lacks is then
    initialised as from_pretrained does (where no `init` is given). Allocated on `device` where `init` runs (it then
    runs at the device's speed: a CPU fills a 5B model's random weights in minutes), else on the CPU, where the
    checkpoint's values are read. Checks up front that every tensor gets a value; a Hugging Face model is tied,
    untied and cast here, before its chunks are laid out (`PretrainedCheckpoint`)."""

    def __init__(self, model: nn.Module, init, weights: str | Path | None, device: torch.device):
        self.init = init
        self.device = device if init is not None else torch.device("cpu")
        checkpoint = SafetensorsWeights(weights) if weights is not None else None
        self.pretrained = None
        if checkpoint is not None and is_hugging_face_model(model):
            self.pretrained = PretrainedCheckpoint(model, checkpoint, str(weights))
        self.values = self.pretrained if self.pretrained is not None else checkpoint
        self.names: dict[int, list[str]] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.names.setdefault(id(t), []).append(name)
        self.prefix = {id(m): f"{name}." if name else "" for name, m in model.named_modules()}
        self.done: set[int] = set()  # modules
        self.filled: set[int] = set()  # tensors given their values
        if self.pretrained is None:
            self._check(model, checkpoint)

    def _check(self, model: nn.Module, checkpoint: SafetensorsWeights | None) -> None:
        known = checkpoint.files if checkpoint is not None else {}
        lacking = [
            (name, t)
            for name, t in [*model.named_parameters(), *model.named_buffers()]
            if not any(n in known for n in self.names[id(t)])
        ]
        meta = [n for n, t in lacking if t.is_meta]
        if meta and self.init is None:
            where = "the checkpoint has no values for them" if checkpoint is not None else "nothing fills them"
            raise ValueError(
                f"{len(meta)} parameters and buffers of the model are on the meta device and {where} (e.g. "
                f"{meta[0]!r}); pass init=fn, where fn(module) fills a module's own parameters and buffers after "
                "they are allocated (or build the model with accelerate's init_empty_weights(include_buffers=False), "
                "so that buffers are real, and call model.tie_weights() after it: it unties a head from its embedding)"
            )
        params = [n for n, t in lacking if isinstance(t, nn.Parameter)]
        if checkpoint is not None and params and self.init is None:
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
        if not meta and self.values is None:
            return
        meta_buffers = {name for name, b in module.named_buffers(recurse=False) if b.is_meta}
        for p in module.parameters(recurse=False):
            if p.is_meta:
                real = nn.Parameter(torch.empty_like(p, device=self.device), requires_grad=p.requires_grad)
                real.__dict__.update(p.__dict__)
                torch.utils.swap_tensors(p, real)
        for name in meta_buffers:
            b = module._buffers[name]
            module._buffers[name] = torch.empty_like(b, device=self.device)
            self.names[id(module._buffers[name])] = self.names.pop(id(b), [f"{self.prefix[id(module)]}{name}"])
        with torch.no_grad():
            if meta and self.init is not None:
                self.init(module)
        if self.values is not None:
            self._fill(module, meta_buffers)

    def _fill(self, module: nn.Module, meta_buffers: set[str]) -> None:
        """The checkpoint's values into the module's own tensors (a tied tensor once: another module holding it may
        be in chunks by now); in a Hugging Face model with no `init`, those it lacks initialised by the model's
        `_init_weights`: parameters, persistent buffers and buffers allocated above (a non-persistent buffer
        computed when the model was built keeps its value)."""
        prefix = self.prefix[id(module)]
        mine = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        lacking = []
        for name, t in mine:
            if id(t) in self.filled:
                continue
            self.filled.add(id(t))
            value = self.values.value(self.names.get(id(t), [f"{prefix}{name}"]), t)
            if value is None:
                lacking.append(name)
                continue
            with torch.no_grad():
                t.copy_(value)
        if self.pretrained is None or self.init is not None:
            return
        kept = module._non_persistent_buffers_set - meta_buffers
        if any(name not in kept for name in lacking):
            self.pretrained.initialise(module, [t for name, t in mine if name not in lacking or name in kept])

    def close(self) -> None:
        if self.values is not None:
            self.values.close()
