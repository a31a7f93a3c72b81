"""Where no plan fits: the error (`NoPlanFits`), what would make one fit, in numbers from the same cost model.

    raise NoPlanFits(reserved, smallest, capacity, n_chunk=8, batch=batch_share(model, configs, capacity, host))

Its message names the forced fields (the user's plan, or chunks already built) and the levers:
- the forced fields searched instead (`Released`: `plan_graph` searches a copy without them): the plan it finds,
  its GPU and host bytes, the most persistent chunks that fit; or that offloading needs more host than there is;
- a smaller batch (`batch_share`): the cost model's activation terms (the profile's per-node peaks, each block's
  saved, output and transient bytes) all scale with the batch, so a configuration's activation peak is linear
  in it and the largest share that fits is found in closed form;
- more GPUs, free memory, the capacity options.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from protrain_fx.planner.cost import Candidate, CostModel, ModeTerms

GENERIC_ORIGIN = "options['plan'], protrain_fx.prepare's plan or the chunks already built"


def _gib(n: float | None) -> str:
    assert n is not None, "a size the message names is known"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _config(config: Candidate) -> str:
    """Its fields as `name=value`, but no chunk sharded on the device where there is none (one rank)."""
    fields = [f.name for f in dataclasses.fields(config) if f.name != "n_device_shard" or config.n_device_shard]
    return " ".join(f"{name}={getattr(config, name)}" for name in fields)


@dataclasses.dataclass(frozen=True)
class BatchShare:
    """The batch lever: the largest share of the profiled activations with which a configuration fits (`share`;
    0 where none does even with no activations), that configuration and its activation peak as profiled;
    `least_bytes`: with no activations, the least reserved bytes of a configuration whose chunks fit the host
    (None: none's do); `host_checked`: the host was budgeted."""

    share: float
    config: Candidate | None = None
    activation_bytes: int = 0
    least_bytes: int | None = None
    host_checked: bool = False


@dataclasses.dataclass(frozen=True)
class Released:
    """The search with the forced `fields` searched too: the plan it finds (`config`, its reserved bytes and its
    host bytes) and the most persistent chunks of any configuration that fits (None where n_persist was not
    forced); or `error`, where it finds none."""

    fields: tuple[str, ...]
    config: Candidate | None = None
    reserved_bytes: int = 0
    host_bytes: int = 0
    most_persistent: int | None = None
    error: NoPlanFits | None = None


def batch_share(
    model: CostModel, configs: Iterable[Candidate], capacity_bytes: int | None, host_bytes: int | None
) -> BatchShare:
    """The largest share f of the profiled activations with which one of `configs` fits the GPU and the host.
    Every term of `CostModel.activation_peak` scales with the batch, so a configuration reserves
    alpha * (f * activations + states + other bytes), and its swapped blocks take f times their bytes of the host:
    each configuration's f is a ratio. An estimate: the profile is of one batch, and not every byte of its peaks
    need scale (the loss's scalars, a graph's own parameter gradients)."""
    known: dict[tuple[int, int, int], ModeTerms] = {}  # per block layout: its activation peak and swapped bytes
    best, least = BatchShare(0.0), None
    gpu = math.inf if capacity_bytes is None else capacity_bytes / model.alpha
    for config in configs:
        key = (config.n_swap, config.n_checkpoint, config.n_selective)
        if key not in known:
            modes = model.modes(config)
            swapped = sum(model.saving(b, m) for b, m in enumerate(modes) if m == "swap")
            known[key] = ModeTerms(model.activation_peak(modes), 0.0, swapped, None)
        terms = known[key]
        activations, swapped = terms.activation_peak, terms.swapped_bytes
        unbatched = model.state_bytes(config) + model.other_bytes
        chunks = model.least_host_bytes(config, terms) - swapped
        if host_bytes is not None and chunks > host_bytes:
            continue
        if least is None or unbatched < least:
            least = unbatched
        share = (gpu - unbatched) / activations if activations else (math.inf if unbatched <= gpu else -math.inf)
        if host_bytes is not None and swapped:
            share = min(share, (host_bytes - chunks) / swapped)
        if share > best.share:
            best = BatchShare(share, config, activations)
    least_bytes = None if least is None else int(least * model.alpha)
    return dataclasses.replace(best, least_bytes=least_bytes, host_checked=host_bytes is not None)


class NoPlanFits(ValueError):
    """No configuration fits. Either even the one needing the least GPU memory does not fit the GPU (`peak_bytes`:
    its reserved bytes), or every one that fits the GPU needs more host memory than this rank has (`host_needed`:
    the least of them, `config`; `host_bytes`: what there is). What would fit: `batch` (a smaller batch),
    `released` (the `forced` fields searched instead; `forced_by`: where each came from)."""

    def __init__(
        self,
        peak_bytes: int,
        config: Candidate,
        capacity_bytes: int | None,
        host_needed: int | None = None,
        host_bytes: int | None = None,
        *,
        n_chunk: int = 0,
        batch: BatchShare | None = None,
        forced: Mapping[str, Any] | None = None,
        forced_by: Mapping[str, str] | None = None,
        released: Released | None = None,
        compile_workers_bytes: int = 0,
        machine_ranks: int = 1,
    ):
        self.peak_bytes, self.config, self.capacity_bytes = peak_bytes, config, capacity_bytes
        self.host_needed, self.host_bytes = host_needed, host_bytes
        self.n_chunk, self.batch, self.released = n_chunk, batch, released
        self.compile_workers_bytes, self.machine_ranks = compile_workers_bytes, machine_ranks
        self.forced, self.forced_by = dict(forced or {}), dict(forced_by or {})
        super().__init__(self._message())

    def told(
        self,
        *,
        forced: Mapping[str, Any],
        forced_by: Mapping[str, str],
        released: Released | None,
        compile_workers_bytes: int = 0,
        machine_ranks: int = 1,
    ):
        """The same error, also naming the forced fields, what searching them would give, the host memory kept
        for inductor's compile workers (`compile_workers_bytes`) and the ranks sharing this machine's host."""
        return NoPlanFits(
            self.peak_bytes,
            self.config,
            self.capacity_bytes,
            self.host_needed,
            self.host_bytes,
            n_chunk=self.n_chunk,
            batch=self.batch,
            forced=forced,
            forced_by=forced_by,
            released=released,
            compile_workers_bytes=compile_workers_bytes,
            machine_ranks=machine_ranks,
        )

    def _message(self) -> str:
        if self.host_needed is None:
            head = (
                f"no plan fits the GPU: the smallest ({self.config}) needs {_gib(self.peak_bytes)}, the GPU has "
                f"{_gib(self.capacity_bytes)} for it{self._forced_text()}."
            )
        else:
            head = (
                f"no plan fits the host memory: the plans that fit the GPU need at least {_gib(self.host_needed)} "
                f"of it for this rank (the least, {self.config}, for its offloaded chunks' masters, AdamW states "
                f"and gradients and its swap space), and there are {_gib(self.host_bytes)}{self._machine_text()}: "
                f"too little to offload the chunks the GPU has no room for{self._forced_text()}."
            )
        levers = [self._released_text(), self._batch_text()]
        if self.host_needed is None:
            levers += [
                "more GPUs: chunks are sharded across ranks, each holding its share of the model states",
                "free GPU memory; if the capacity is wrong, set options={'gpu_memory_bytes': ...}",
            ]
            if self.n_chunk and "n_persist" not in self.forced:
                levers.append(
                    f"more host memory would not help: the smallest plan offloads {self.n_chunk - self.config.n_persist}"
                    f" of the {self.n_chunk} chunks already"
                )
        else:
            levers += [
                "more GPUs: each rank holds its shard of the offloaded chunks",
                "free host memory or use a machine with more, or use a smaller model",
                self._workers_text(),
                "if the host capacity is wrong, set options={'host_memory_bytes': ...}",
            ]
        return head + " What would make it fit:\n" + "\n".join(f"- {lever}" for lever in levers if lever)

    def _machine_text(self) -> str:
        """' (4 ranks share this machine's host: 480 GiB in all, of the 400 GiB it gives them)'."""
        if self.machine_ranks <= 1:
            return ""
        assert self.host_needed is not None and self.host_bytes is not None, "named where the host is short"
        n = self.machine_ranks
        return (
            f" ({n} ranks share this machine's host: {_gib(n * self.host_needed)} in all, of the "
            f"{_gib(n * self.host_bytes)} it gives them)"
        )

    def _workers_text(self) -> str:
        """The host memory kept for inductor's compile workers, where some was: compiling in the process frees it."""
        if not self.compile_workers_bytes:
            return ""
        assert self.host_needed is not None and self.host_bytes is not None, "named where the host is short"
        short = self.host_needed - self.host_bytes
        enough = "enough" if self.compile_workers_bytes >= short else f"not enough alone: {_gib(short)} are missing"
        return (
            f"set TORCHINDUCTOR_COMPILE_THREADS=1: inductor then compiles in this process, and the "
            f"{_gib(self.compile_workers_bytes)} of host memory kept for its compile workers go to the model "
            f"({enough})"
        )

    def _forced_text(self) -> str:
        """', with n_persist=14 forced by ...' (the fields grouped by where they came from)."""
        if not self.forced:
            return ""
        by: dict[str, list[str]] = {}
        for key, value in self.forced.items():
            shown = f"{key}={value}"
            if key == "block_modes":  # (one mode a block: their counts)
                counts = ", ".join(f"{value.count(m)} {m}" for m in ("swap", "checkpoint", "selective"))
                shown = f"block_modes ({counts} of {len(value)} blocks)"
            by.setdefault(self.forced_by.get(key, GENERIC_ORIGIN), []).append(shown)
        return ", with " + "; ".join(f"{', '.join(fields)} forced by {origin}" for origin, fields in by.items())

    def _released_text(self) -> str:
        released = self.released
        if released is None or not released.fields:
            return ""
        names = ", ".join(released.fields)
        error = released.error
        if error is not None and error.host_needed is not None:
            return (
                f"with {names} searched instead, the plans that fit the GPU offload chunks and need at least "
                f"{_gib(error.host_needed)} of host memory ({error.config}), and this rank has "
                f"{_gib(error.host_bytes)}: offloading is not available on this host"
            )
        if error is not None:
            return (
                f"with {names} searched instead none fits either: the smallest ({error.config}) needs "
                f"{_gib(error.peak_bytes)}"
            )
        assert released.config is not None, "a search that raised no error found a plan"
        text = (
            f"with {names} searched instead, the search plans {_config(released.config)}: predicted "
            f"{_gib(released.reserved_bytes)} of the GPU"
        )
        if released.host_bytes:
            text += f" and {_gib(released.host_bytes)} of host memory (its offloaded chunks and swap space)"
        if released.most_persistent not in (None, released.config.n_persist):
            text += f"; at most n_persist={released.most_persistent} fits"
        return text + ". Leave them out where they were forced (or force these values there)"

    def _batch_text(self) -> str:
        batch = self.batch
        if batch is None:
            return ""
        share = math.floor(min(batch.share, 0.99) * 100) / 100  # (none fits at the whole batch)
        if share > 0:
            return (
                f"a smaller batch: about {share:.2f}x the current one fits, as estimated from the profile "
                f"({batch.config}: {_gib(batch.activation_bytes)} of activations as profiled, taken to scale with "
                "the batch); or a sequence shortened alike"
            )
        if batch.least_bytes is None:
            return "a smaller batch would not do: the offloaded chunks of no plan fit the host"
        plans = "the plans whose offloaded chunks fit the host" if batch.host_checked else "the plans"
        return (
            f"a smaller batch would not do: even with no activations {plans} need at least "
            f"{_gib(batch.least_bytes)} of the GPU (model states and what else it holds)"
        )
