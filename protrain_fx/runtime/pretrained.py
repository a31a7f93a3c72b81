"""A Hugging Face model's checkpoint read by transformers' own loading rules, for `prepare(model, weights=path)`:
what `from_pretrained(path)` would load into the model, decided from the checkpoint's header before any tensor is
read; each model tensor's value is made when `prepare` fills its module, so the host holds one model tensor and
the checkpoint tensors it is made from at a time.

Taken from transformers, not redone (`core_model_loading`, `conversion_mapping`, `modeling_utils`,
`utils/loading_report`):

- keys renamed and converted by the model class's mapping (`get_model_conversion_mapping`: a GPT-NeoX head saved as
  `embed_out.weight`, a Mixtral's per-expert weights merged into one tensor), the base-model prefix added or dropped
  (`rename_source_key`: a `LlamaModel` checkpoint into `LlamaForCausalLM` and back), grouped per model tensor as
  `convert_and_load_state_dict_in_model` groups them, each group converted by the transform itself;
- tied weights tied by `tie_weights(missing_keys=...)` (a head saved alone ties the embedding to it), except that
  both tensors in the checkpoint with different values are untied, as from_pretrained leaves them;
- tensors the checkpoint lacks initialised by the `_init_weights` of the (sub-)model they belong to, under the
  guard that keeps loaded tensors, on the module being filled;
- the dtype (`_get_dtype` with `dtype="auto"`; `get_init_context` and `_get_dtype_plan` for each tensor's own);
- the report of missing, unexpected and mismatched keys (`log_state_dict_report`, on this module's logger), and a
  mismatched shape or a failed conversion an error, as from_pretrained raises one without
  `ignore_mismatched_sizes`.

What a model built already cannot mirror exactly (README's supported list says so):

- the dtype: from_pretrained builds the model in the dtype it loads. A model built with a dtype in its config
  (`from_config(config, dtype=...)`, a config read from a checkpoint) keeps that one, as `from_pretrained(path,
  config=model.config)` does; one cast since (`model.to(torch.bfloat16)`) keeps its own; one built in torch's
  default dtype with none in its config takes the checkpoint's, each tensor cast in place, with a warning;
- a checkpoint whose config names another model type is refused (from_pretrained only warns, then loads what fits);
- random draws of several missing modules come in the order prepare fills them, not initialize_weights' order;
- non-persistent buffers computed when the model was built keep their values (from_pretrained computes them again
  with `_init_weights`; the same function builds them, so the values agree); those on the meta device are made by
  `_init_weights`.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from protrain_fx.runtime.chunks import OPTIMIZER_ATTR

if TYPE_CHECKING:
    from protrain_fx.runtime.weights import SafetensorsWeights

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


def is_hugging_face_model(model: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


@dataclass
class _Group:
    """One entry of transformers' `param_name_to_load`: the checkpoint keys one transform turns into model tensors
    (a rename: one key into one tensor; a converter: several keys into one or more tensors). `template` is copied
    for each conversion and never converted itself."""

    key: str  # the first target, the name transformers converts it under
    template: Any  # a transformers WeightTransform
    sources: list[tuple[str, str, str]] = field(default_factory=list)  # (target key, checkpoint key, source pattern)


class PretrainedCheckpoint:
    """What `from_pretrained` would load into `model` (a transformers `PreTrainedModel`) from `checkpoint`, planned
    on construction (the model is tied, untied and cast there, before anything is built from it); `value(names,
    dtype)` then makes one model tensor's value, `initialise(module, loaded)` what the checkpoint lacks."""

    def __init__(self, model: nn.Module, checkpoint: SafetensorsWeights, path: str):
        from transformers.utils.loading_report import LoadStateDictInfo

        self.model, self.checkpoint, self.path = model, checkpoint, path
        saved_config = _saved_config(checkpoint.folder)
        _check_architecture(model, saved_config, path)
        self.info = LoadStateDictInfo(
            missing_keys=set(),
            unexpected_keys=set(),
            mismatched_keys=set(),
            error_msgs=[],
            conversion_errors={},
            skipped_pp_keys=set(),
        )
        self.expected = model.state_dict()
        self.groups = self._group_keys()
        self.source_of = self._plan_targets()  # model key -> the group that makes its value
        self.info.missing_keys = set(self.expected) - set(self.source_of) - {k for k, _, _ in self.info.mismatched_keys}
        del self.expected  # (the model's tensors before tying and casting)
        self._tie()
        self.report()  # (raises where a shape is mismatched or a conversion failed)
        cast_to_loaded_dtype(model, checkpoint, saved_config, set(self.source_of))
        self.owner = _owning_models(model)
        self.pending: dict[str, torch.Tensor] = {}  # values made by a group for other tensors than the one asked
        self.done: set[int] = set()  # groups converted (by id)

    def _group_keys(self) -> dict[str, _Group]:
        """The checkpoint's keys renamed (the class's renames, at most one converter, the base-model prefix) and
        grouped as `convert_and_load_state_dict_in_model` does; keys that name no model tensor are unexpected."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self.conversions = get_model_conversion_mapping(self.model)
        renamings = [c for c in self.conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in self.conversions if isinstance(c, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = self.model.base_model_prefix
        groups: dict[str, _Group] = {}
        for key in sorted(self.checkpoint.files, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, self.expected)
            if renamed not in self.expected and key in self.expected:  # (a key that names a model tensor as it is)
                renamed, pattern = rename_source_key(key, [], [], prefix, self.expected)
            if renamed in self.expected:
                if pattern is None:
                    group = groups.setdefault(renamed, _Group(renamed, WeightRenaming(key, renamed)))
                    pattern = key
                else:
                    group = groups.setdefault(renamed, _Group(renamed, copy.deepcopy(by_pattern[pattern])))
                group.sources.append((renamed, key, pattern))
            elif pattern is not None:
                targets = by_pattern[pattern].target_patterns
                self.info.unexpected_keys.update(renamed.replace(targets[0], t) for t in targets)
            else:
                self.info.unexpected_keys.add(renamed)
        self.model._weight_conversions = [c for c in self.conversions if c.was_used()]  # (save_pretrained reverts them)
        return groups

    def _convert(self, group: _Group, read, dtype: torch.dtype | None, info=None) -> dict[str, torch.Tensor]:
        """The model tensors `group` makes, its checkpoint tensors given by `read(key)`, cast to `dtype` first (as
        from_pretrained materialises them in the dtype of the tensor they fill); a conversion's error is recorded
        in `info` where given (transformers then raises SkipParameters), else raised."""
        transform = copy.deepcopy(group.template)
        for target, key, pattern in group.sources:
            transform.add_tensor(
                target, key, pattern, lambda key=key: read(key) if dtype is None else read(key).to(dtype)
            )
        out = transform.convert(group.key, model=self.model, config=self.model.config, loading_info=info)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    def _plan_targets(self) -> dict[str, _Group]:
        """Every group converted on the meta device (the checkpoint's shapes and dtypes, nothing read): which model
        tensors it makes, and those whose shape is not the model's (mismatched)."""
        from transformers.core_model_loading import SkipParameters

        source_of = {}
        for group in self.groups.values():
            try:
                made = self._convert(group, self.checkpoint.header_tensor, None, self.info)
            except SkipParameters:  # (recorded in info.conversion_errors)
                continue
            for key, value in made.items():
                if key not in self.expected:
                    self.info.unexpected_keys.add(key)
                elif value.shape != self.expected[key].shape:
                    self.info.mismatched_keys.add((key, value.shape, self.expected[key].shape))
                else:
                    source_of[key] = group
        return source_of

    def _tie(self) -> None:
        """The model's tied weights as from_pretrained ties them after loading (`tie_weights(missing_keys=...)`),
        done now, before the chunks are laid out; a pair both in the checkpoint stays tied only where the values
        are equal (from_pretrained compares them once loaded), else it is untied, with transformers' warning."""
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        both = [(t, s) for t, s in tied.items() if t in self.source_of and s in self.source_of]
        untie = [(t, s) for t, s in both if not torch.equal(self._value_now(t), self._value_now(s))]
        params = dict(self.model.named_parameters(remove_duplicate=False))
        changed = [(t, s) for t, s in tied.items() if (t, s) in untie or params.get(t) is not params.get(s)]
        held = [n for pair in changed for n in pair if OPTIMIZER_ATTR in getattr(params.get(n), "__dict__", {})]
        if held:
            raise ValueError(
                f"prepare(weights=...) ties or unties {held[0]!r} as from_pretrained does for this checkpoint, but a "
                "protrain_fx.optim.AdamW holds it already: build the optimizer after prepare (or call "
                "model.tie_weights() before building it)"
            )
        for target, source in untie:
            log.warning(
                "The tied weights mapping and config for this model specifies to tie %s to %s, but both are present "
                "in the checkpoints with different values, so we will NOT tie them. You should update the config "
                "with `tie_word_embeddings=False` to silence this warning.",
                source,
                target,
            )
            self.model.all_tied_weights_keys.pop(target)
            if params.get(target) is params.get(source):
                _untie(self.model, target)
        self.info.missing_keys.update(t for t, s in both if (t, s) not in untie)  # (tied below, then not missing)
        if tied:
            self.model.tie_weights(missing_keys=self.info.missing_keys, recompute_mapping=False)

    def _value_now(self, key: str) -> torch.Tensor:
        return self._convert(self.source_of[key], self.checkpoint.read, None)[key]

    def report(self) -> None:
        """from_pretrained's report of the keys (logged as a warning where any is missing, unexpected or
        mismatched); a mismatched shape or a conversion that failed is an error."""
        from transformers.utils.loading_report import log_state_dict_report

        shown = copy.copy(self.info)
        shown.missing_keys, shown.unexpected_keys = set(shown.missing_keys), set(shown.unexpected_keys)
        self.model._adjust_missing_and_unexpected_keys(shown)  # (the class's keys to ignore, old buffers)
        try:
            log_state_dict_report(self.model, self.path, False, shown, logger=log)
        except RuntimeError as error:
            raise ValueError(
                f"prepare(weights={self.path!r}): the checkpoint does not fit {type(self.model).__name__} (see the "
                "load report logged above: tensors of other shapes, or conversions that failed); build the model from "
                "the checkpoint's own config (config = AutoConfig.from_pretrained(path), then "
                "AutoModelForCausalLM.from_config(config)), or pass a checkpoint of this model's configuration"
            ) from error

    def value(self, names: list[str], like: torch.Tensor) -> torch.Tensor | None:
        """The value of the model tensor `like`, known by `names` (a tied tensor has several), in its dtype, or None
        where the checkpoint has none. A group that makes several tensors (one checkpoint tensor split in three)
        keeps the others until their modules are filled."""
        found = next((n for n in names if n in self.pending), None)
        if found is not None:
            value = self.pending.pop(found)
            for n in names:
                self.pending.pop(n, None)
            return value
        key = next((n for n in names if n in self.source_of and id(self.source_of[n]) not in self.done), None)
        if key is None:
            return None
        group = self.source_of[key]
        self.done.add(id(group))
        made = self._convert(group, self.checkpoint.read, like.dtype)
        value = made.pop(key)
        self.pending.update((k, v) for k, v in made.items() if k in self.source_of and k not in names)
        return value

    def initialise(self, module: nn.Module, loaded: list[torch.Tensor]) -> None:
        """`module`'s tensors the checkpoint has no values for, initialised by the `_init_weights` of the (sub-)model
        it belongs to, as `initialize_weights` does; `loaded` (its tensors that have their values) marked so that the
        guarded init functions leave them."""
        from transformers import initialization

        marked = [t for t in loaded if not getattr(t, "_is_hf_initialized", False)]
        for t in marked:
            t._is_hf_initialized = True
        try:
            with torch.no_grad(), initialization.guard_torch_init_functions():
                self.owner[id(module)]._init_weights(module)
        finally:
            for t in marked:
                del t._is_hf_initialized

    def close(self) -> None:
        if self.pending:  # (values made for tensors that were never filled: none is expected)
            log.debug(
                "prepare(weights=...): %d converted values left unused: %s", len(self.pending), list(self.pending)
            )
        self.pending.clear()


def _saved_config(folder: Path | None) -> dict[str, Any] | None:
    file = folder / CONFIG_FILE if folder is not None else None
    return json.loads(file.read_text()) if file is not None and file.is_file() else None


def _check_architecture(model: nn.Module, saved: dict[str, Any] | None, path: str) -> None:
    """A checkpoint whose config.json names another model type than the model's (or its sub-models') is refused:
    from_pretrained warns and loads what fits, which leaves a model of one architecture with another's weights."""
    if saved is None or "model_type" not in saved:
        return
    config = model.config
    types = {config.model_type} | {
        getattr(getattr(config, k, None), "model_type", None) for k in getattr(config, "sub_configs", {})
    }
    if saved["model_type"] in types:
        return
    architectures = ", ".join(saved.get("architectures") or []) or "no architectures listed"
    raise ValueError(
        f"prepare(weights={path!r}): the checkpoint is of another architecture: its config.json has model_type "
        f"{saved['model_type']!r} ({architectures}), the model is {type(model).__name__} (model_type "
        f"{config.model_type!r}). Build the model from the checkpoint's own config (config = "
        "AutoConfig.from_pretrained(path); model = AutoModelForCausalLM.from_config(config), or "
        "protrain_fx.from_pretrained(AutoModelForCausalLM, path)), or pass a checkpoint saved from a "
        f"{type(model).__name__}"
    )


def _untie(model: nn.Module, name: str) -> None:
    """Give the parameter `name` a tensor of its own (it shared one with the weight it was tied to)."""
    parent, _, attr = name.rpartition(".")
    module = model.get_submodule(parent)
    p = getattr(module, attr)
    own = torch.empty_like(p) if p.is_meta else p.detach().clone()
    setattr(module, attr, nn.Parameter(own, requires_grad=p.requires_grad))


def _owning_models(model: nn.Module) -> dict[int, nn.Module]:
    """Each module's nearest `PreTrainedModel` (itself, or the closest above it): whose `_init_weights` initialises
    it, as `initialize_weights` dispatches (a composite model's sub-models initialise their own modules)."""
    from transformers import PreTrainedModel

    owner: dict[int, nn.Module] = {}

    def walk(module: nn.Module, above: nn.Module) -> None:
        mine = module if isinstance(module, PreTrainedModel) else above
        owner.setdefault(id(module), mine)
        for child in module.children():
            walk(child, mine)

    walk(model, model)
    return owner


def loaded_dtype(
    model: nn.Module, checkpoint: SafetensorsWeights, saved: dict[str, Any] | None
) -> tuple[torch.dtype, str]:
    """The dtype from_pretrained loads in, and where it comes from: the model config's (as `from_pretrained(path,
    config=model.config)` reads it), else the model's own where it is not torch's default (cast since it was
    built), else the checkpoint's as `from_pretrained(path)` picks it (`_get_dtype` with "auto": its config's, its
    index's, its first floating tensor's)."""
    from transformers.modeling_utils import _get_dtype

    given = model.config.dtype
    if given is not None:
        return (getattr(torch, given) if isinstance(given, str) else given), "the dtype in its config"
    if model.dtype != torch.get_default_dtype():
        return model.dtype, "its own dtype"
    probe = copy.deepcopy(model.config)
    probe.dtype = (saved or {}).get("dtype", (saved or {}).get("torch_dtype"))
    files = sorted({str(f) for f in checkpoint.files.values()})
    return _get_dtype("auto", files, probe, checkpoint.index_metadata, None, True)[1], "the checkpoint's dtype"


def cast_to_loaded_dtype(
    model: nn.Module, checkpoint: SafetensorsWeights, saved: dict[str, Any] | None, loaded: set[str]
) -> None:
    """Each tensor of the model in the dtype from_pretrained gives it (`loaded_dtype`; a tensor built in a dtype of
    its own, as RoPE's float32 frequencies, keeps it; one the class keeps in float32 and the checkpoint fills, in
    float32), cast in place (parameters stay the same objects); the config records the dtype, as from_pretrained's
    does."""
    dtype, why = loaded_dtype(model, checkpoint, saved)
    plan = model._get_dtype_plan(dtype)
    before = model.dtype
    if dtype == before and not plan:
        _record_dtype(model.config, dtype)
        return
    built = _dtypes_built_in(model, dtype)
    if plan:
        from transformers.core_model_loading import build_glob_alternation

        pattern, by_group, _ = build_glob_alternation(list(plan))
        for name in loaded:
            if (m := pattern.search(name)) is not None:
                built[name] = plan[by_group[m.lastgroup]]
    want = {}  # id of a tensor -> its dtype (a tensor under several names: the first)
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        want.setdefault(id(t), built.get(name, dtype if t.is_floating_point() and t.dtype == before else t.dtype))
    cast: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.dtype != want[id(p)]:
                p.data = p.data.to(want[id(p)])
                cast[id(p)] = p
        for name, b in module.named_buffers(recurse=False):
            if b.dtype != want[id(b)]:
                module._buffers[name] = cast.setdefault(id(b), b.to(want[id(b)]))
    _record_dtype(model.config, dtype)
    if cast and before != dtype:
        keep = str(before).removeprefix("torch.")
        log.warning(
            "prepare(weights=...): %s was built in %s; from_pretrained loads this checkpoint in %s (%s), so %d of "
            "its tensors are cast to it. To keep %s, build the model with that dtype "
            "(AutoModelForCausalLM.from_config(config, dtype=torch.%s)) or set model.config.dtype = torch.%s before "
            "prepare",
            type(model).__name__,
            keep,
            str(dtype).removeprefix("torch."),
            why,
            len(cast),
            keep,
            keep,
            keep,
        )


def _dtypes_built_in(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Each tensor's dtype by name in a model of the same class and config built as from_pretrained builds it in
    `dtype` (its `get_init_context`: the meta device, torch's default dtype set to `dtype`; no memory). A tensor it
    does not name (added after the model was built) is cast where it has the model's dtype."""
    from transformers.utils.generic import ContextManagers

    cls = type(model)
    config = copy.deepcopy(model.config)
    given = (config,) if "config" in inspect.signature(cls.get_init_context).parameters else ()  # (transformers 5.2x)
    try:
        with ContextManagers(cls.get_init_context(dtype, False, False, False, *given)):
            ref = cls(config)
    except Exception:  # (a model class that cannot be built so: the model's dtype rule, by tensor)
        log.debug("prepare(weights=...): %s not built on the meta device; tensors cast by dtype", cls.__name__)
        return {}
    return {n: t.dtype for n, t in [*ref.named_parameters(), *ref.named_buffers()]}


def _record_dtype(config: Any, dtype: torch.dtype) -> None:
    config.dtype = dtype
    for key in getattr(config, "sub_configs", {}):
        if (sub := getattr(config, key, None)) is not None:
            sub.dtype = dtype


def from_pretrained(
    cls: Any,
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    plan: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
    config: Any = None,
    **config_kwargs: Any,
) -> nn.Module:
    """`cls.from_pretrained(path)` with the model's trainable parameters in chunks, in one call: the model is built
    on the meta device from the checkpoint's config (`cls.config_class`, or AutoConfig for an auto class; or
    `config`), then `protrain_fx.prepare(model, weights=path, plan=plan, device=device)` fills it one tensor at a
    time, by from_pretrained's rules. `cls`: a transformers model class (LlamaForCausalLM) or auto class
    (AutoModelForCausalLM); `dtype`: as from_pretrained's (default: the checkpoint's); `config_kwargs` update the
    config as from_pretrained's keyword arguments do. Returned in eval mode, as from_pretrained returns a model;
    call `model.train()` to train it. A local safetensors folder only (nothing is downloaded)."""
    from transformers import AutoConfig

    from protrain_fx.runtime.adopt import prepare

    if config is None:
        reader = getattr(cls, "config_class", None) or AutoConfig
        config = reader.from_pretrained(path, **config_kwargs)
    else:
        config = copy.deepcopy(config)
        config.update(config_kwargs)
    build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    with torch.device("meta"):
        model = build(config) if dtype in (None, "auto") else build(config, dtype=dtype)
    model.config.name_or_path = str(path)
    prepare(model, weights=path, plan=plan, device=device)
    return model.eval()
