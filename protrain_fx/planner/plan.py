"""The plan: every memory decision for one compiled graph, made once and frozen.

Later stages only read it. It is JSON-serializable so it can be dumped and replayed
(`options={"plan": "plan.json"}`). The fields the user does not force are searched (planner/search.py:
`plan_graph`); `make_plan` builds a plan from forced fields alone, and there every chunk is persistent and no
block optimized unless forced (as in `protrain_fx.prepare`, which runs before any search).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from protrain_fx.planner.chunking import ChunkLayout

# per block: keep every activation, recompute the whole block, recompute its cheap ops only (keeping the outputs of
# library kernels: passes/activations.py), or swap its activations to the host
BLOCK_MODES = ("none", "checkpoint", "selective", "swap")
MASTER_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}  # the master dtypes a plan may name, and their size
# What the chunk runtime (runtime/chunks/) holds, which the cost model (planner/memory_model.py) counts:
REDUCE_BUFFERS = 2  # master-dtype chunk buffers gradients are reduced in: one copied to the host while the next fills
# what an offloaded shard always holds of the host, in elements of the master dtype: its master (the parameters'
# only host copy) and the host AdamW's two states. Its gradient shard is one more (one per offloaded chunk, or
# fewer, shared in turn)
HOST_STATES = 3
# the fewest shared gradient shards a plan may have: one lands while the host updates from the other
MIN_GRAD_SLOTS = 2
# the chunk buffers the search gives offloaded chunks at least (planner/search.py `candidates`): the chunk computing
# and the one loading, and where blocks are recomputed the chunk a recomputed block reads. It gives that many even
# to a model with fewer chunks, so a forced `n_buffer` may be up to the model's chunk count or this, whichever is
# more (a searched plan, dumped and replayed, is accepted); a buffer holds one chunk, so more is never used
LEAST_BUFFERS, LEAST_BUFFERS_RECOMPUTING = 2, 3


@dataclasses.dataclass(frozen=True)
class Plan:
    n_persist: int = 0  # chunks kept on the GPU (the first n_persist in execution order)
    n_buffer: int = 0  # pre-allocated GPU buffers for non-persistent chunks
    # chunks after the persistent ones sharded across the ranks on the GPUs (ZeRO-3 on the device): each rank holds
    # its shard's master, gradient and AdamW states there, gathered into the buffers like an offloaded chunk and
    # updated on the GPU; the chunks after them are offloaded (sharded on the host, updated by the CPU)
    n_device_shard: int = 0
    n_swap: int = 0  # blocks whose activations are swapped to CPU memory
    n_checkpoint: int = 0  # blocks recomputed in backward
    n_selective: int = 0  # blocks whose cheap ops (norms, activations, casts, dropout) are recomputed in backward
    swap_interval: int = 1  # blocks of compute that hide one block's swap copy; backward prefetches that far ahead
    n_chunk: int = 0  # chunks of the parameter layout (0: parameters are left where they are)
    n_block: int = 0  # transformer blocks found in the graph
    # bytes of each chunk: what the layout chose (planner/chunking.py `search_layout`: the least padding), or forced
    # to lay the chunks out at that size (at least the largest parameter's). Forced as 0 (the default): chosen by
    # the layout, as when not forced
    chunk_bytes: int = 0
    block_modes: tuple[str, ...] = ()
    # with gradient clipping: the offloaded chunks (the last ones, whose gradients arrive first) that still
    # update during the backward, keeping what they change to undo it where the clip applies (runtime/chunks/updates.py:
    # ChunkManager.speculates); the others update in optimizer.step(). Searched with the cost model (the copy
    # costs host memory bandwidth)
    n_clip_overlap: int = 0
    # the fp32 gradient shards the host holds for the offloaded chunks: one each (n_chunk - n_persist) where it
    # has room, else fewer, which they share, each chunk from its gradient's arrival to its update's end
    # (runtime/chunks/slots.py). Forced: at most that many, at least 1
    host_grad_slots: int = 0
    # the fp32 gradient buffers the GPU holds for the persistent chunks: one each (n_persist), or, where no plan
    # with one each fits the machine, fewer, which they share, each chunk from its gradient's arrival to its
    # update (runtime/chunks/slots.py). Forced: at most that many, at least 1
    device_grad_slots: int = 0
    # what the master weights, gradients and AdamW states are kept in: "float32" (the default), or "bfloat16" for
    # a bfloat16 model, whose parameters are then their own master (what torch.optim.AdamW over a bfloat16 model
    # does: half the optimizer's bytes, with bfloat16's rounding in every update). The user's choice, never searched
    master_dtype: str = "float32"
    predicted_step_s: float | None = None
    # with the host's work planner/search.py's HOST_SLOWDOWN times as long as profiled: part of what plans are ranked
    # by (`ranked_step_s`: with `predicted_step_s` and a step whose clip applies)
    predicted_slow_host_step_s: float | None = None
    predicted_clipped_step_s: float | None = None  # a step with clipping (that does not apply)
    # the host AdamW's mean seconds per parameter in the predicted step (beside the copies predicted there), to
    # set beside the rate training measures (runtime/monitor.py); None where nothing is offloaded
    predicted_host_adam_s_per_param: float | None = None
    predicted_peak_bytes: int | None = None  # allocated, as torch.cuda.max_memory_allocated counts
    predicted_reserved_bytes: int | None = None  # the peak times the fragmentation α: what must fit the GPU
    runners_up: tuple[Plan, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["block_modes"] = list(self.block_modes)
        data["runners_up"] = [p.to_json() for p in self.runners_up]
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def __str__(self) -> str:
        """A table: one row per field, the plan in the first column and its runners-up after it."""
        plans = [self, *self.runners_up]
        names = [f.name for f in dataclasses.fields(self) if f.name != "runners_up"]
        header = ["", "plan", *(f"runner-up {i}" for i in range(1, len(plans)))]
        rows = [header] + [[name, *(_cell(name, getattr(p, name)) for p in plans)] for name in names]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _cell(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name == "block_modes":  # one letter a block: n(one), c(heckpoint), l (selective), s(wap)
        return "".join(MODE_LETTERS[m] for m in value) or "-"
    if name in ("predicted_step_s", "predicted_slow_host_step_s", "predicted_clipped_step_s"):
        return f"{value * 1e3:.1f} ms"
    if name == "predicted_host_adam_s_per_param":
        return f"{value:.3g} s"
    if name in ("predicted_peak_bytes", "predicted_reserved_bytes", "chunk_bytes"):
        return f"{value / 2**20:.1f} MiB"
    return str(value)


MODE_LETTERS = {"none": "n", "checkpoint": "c", "selective": "l", "swap": "s"}
PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))
CHUNK_FIELDS = (
    "n_persist",
    "n_buffer",
    "n_device_shard",
    "n_chunk",
    "chunk_bytes",
    "n_clip_overlap",
    "host_grad_slots",
    "device_grad_slots",
    "master_dtype",
)
ACTIVATION_FIELDS = ("n_swap", "n_checkpoint", "n_selective", "block_modes", "swap_interval")
# the count of blocks in each mode that has one
MODE_COUNTS = {"n_swap": "swap", "n_checkpoint": "checkpoint", "n_selective": "selective"}


# fields a plan records as what came out of the layout and the search; a replayed plan file holds them
OUTPUT_FIELDS = ("n_chunk", "n_block")
INT_FIELDS = tuple(f.name for f in dataclasses.fields(Plan) if f.type in ("int", int) and f.name not in OUTPUT_FIELDS)


def check_forced_fields(forced: Mapping[str, Any]) -> None:
    """The types of `options['plan']`'s fields, checked once when the options are read (what each field means
    against the model is checked by `make_plan`, where the chunk layout is known: `n_persist` and `n_buffer`
    against the chunk count, say): a ValueError naming the field and what it takes. `chunk_bytes` 0 means
    chosen by the layout, as when it is not forced."""
    unknown = sorted(set(forced) - set(PLAN_FIELDS))
    if unknown:
        raise ValueError(f"unknown plan field(s) {unknown} in options['plan']; plan fields are {list(PLAN_FIELDS)}")
    for key in INT_FIELDS:
        if key in forced:
            _int_field(forced, key, 0)
    modes = forced.get("block_modes")
    if modes is not None and (
        isinstance(modes, str) or not isinstance(modes, (list, tuple)) or not all(isinstance(m, str) for m in modes)
    ):
        raise ValueError(
            f"options['plan']['block_modes'] must be a list of modes, one per block (each one of "
            f"{list(BLOCK_MODES)}), got {modes!r}"
        )
    if "master_dtype" in forced:
        master_bytes(forced)


def _check_outputs(forced: Mapping[str, Any], n_block: int, layout: ChunkLayout | None) -> None:
    """A forced output field (a replayed plan file's) must be what this model has."""
    actual = {"n_block": n_block, "n_chunk": layout.n_chunk if layout is not None else 0}
    for key, value in actual.items():
        if key in forced and forced[key] != value:
            raise ValueError(
                f"options['plan'][{key!r}]={forced[key]!r}, but this model has {value}: {key} is an output of the "
                "chunk layout and block search, not a setting (a plan file of another model or layout?); drop it, "
                "and force chunk_bytes to change the layout"
            )


def _check_buffers(n_buffer: int, n_chunk: int) -> None:
    """A forced `n_buffer` the chunks can use: each buffer holds one offloaded chunk, so more buffers than chunks
    stay empty (up to the search's own least, LEAST_BUFFERS_RECOMPUTING, which it gives a model of fewer chunks)."""
    most = max(n_chunk, LEAST_BUFFERS_RECOMPUTING)
    if n_buffer > most:
        raise ValueError(
            f"options['plan']['n_buffer']={n_buffer} is more chunk buffers than this model's {n_chunk} chunks can "
            f"use (a buffer holds one offloaded chunk): at most {most}. Lower it, or drop it to have it searched"
        )


def _int_field(forced: Mapping[str, Any], key: str, default: int) -> int:
    value = forced.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"options['plan'][{key!r}] must be a non-negative int, got {value!r}")
    return value


def grad_slot_fields(
    forced: Mapping[str, Any], n_chunk: int, n_persist: int, n_device_shard: int = 0
) -> dict[str, int]:
    """The gradient shards the offloaded chunks share on the host and the buffers the persistent chunks share on the
    device, as forced (more than one per chunk: one each) or one each. (Chunks sharded on the device hold one
    gradient shard each.)"""
    offloaded = n_chunk - n_persist - n_device_shard
    return {
        "host_grad_slots": _grad_slots(
            forced, "host_grad_slots", offloaded, "chunks are offloaded (gradient shards on the host)"
        ),
        "device_grad_slots": _grad_slots(
            forced, "device_grad_slots", n_persist, "chunks are persistent (gradient buffers on the device)"
        ),
    }


def _grad_slots(forced: Mapping[str, Any], key: str, chunks: int, where: str) -> int:
    """The forced gradient buffers or shards `key` that `chunks` chunks share (at most one each; default one each)."""
    if chunks and key in forced and _int_field(forced, key, 0) < 1:
        raise ValueError(f"options['plan'][{key!r}] must be at least 1 where {where}")
    return min(chunks, _int_field(forced, key, chunks))


def with_default_master(forced: Mapping[str, Any], layout: ChunkLayout | None) -> dict[str, Any]:
    """`forced`, with the master dtype of a float64 model where none is forced: its own (float32 would lose
    precision the model was built with)."""
    if layout is not None and layout.element_size == 8 and "master_dtype" not in forced:
        return {**forced, "master_dtype": "float64"}
    return dict(forced)


def master_bytes(forced: Mapping[str, Any]) -> int:
    """Bytes per element of the forced plan's master dtype (float32 by default)."""
    master_dtype = forced.get("master_dtype", "float32")
    if master_dtype not in MASTER_BYTES:
        raise ValueError(f"options['plan']['master_dtype'] must be one of {list(MASTER_BYTES)}, got {master_dtype!r}")
    return MASTER_BYTES[master_dtype]


def decisions(plan: Mapping[str, Any]) -> dict[str, Any]:
    """A plan's fields (as plan.json holds them) but its predictions and runners-up: forced, they time it again
    with nothing searched."""
    return {k: v for k, v in plan.items() if not k.startswith("predicted_") and k != "runners_up"}


def make_plan(
    n_block: int,
    forced: Mapping[str, Any] | None = None,
    layout: ChunkLayout | None = None,
    *,
    swap_interval: int = 1,
) -> Plan:
    """The plan for a graph of `n_block` blocks, after checking the user's forced fields.

    Without a chunk layout (parameters not managed in chunks) everything stays where it is. With one, the
    forced `n_persist` and `n_buffer` are taken (each at most what the chunk count allows: `_check_buffers`), and by
    default every chunk is persistent. Block modes: the
    forced `block_modes`, else the interleaved layout of the forced `n_swap`, `n_checkpoint` and `n_selective`
    (none by default). `swap_interval` is the measured one (planner/cost.py), unless the user forces another.
    """
    forced = dict(forced or {})
    check_forced_fields(forced)
    _check_outputs(forced, n_block, layout)
    modes = _block_modes(n_block, forced)
    interval = _int_field(forced, "swap_interval", swap_interval)
    if interval < 1:
        raise ValueError("options['plan']['swap_interval'] must be at least 1 (blocks)")
    activations: dict[str, Any] = {"block_modes": modes, "swap_interval": interval}
    activations.update({key: modes.count(mode) for key, mode in MODE_COUNTS.items()})
    size, master_dtype = master_bytes(forced), forced.get("master_dtype", "float32")
    if layout is None:
        chunked = {
            k: forced[k] for k in CHUNK_FIELDS if k not in ("n_persist", "master_dtype") and _int_field(forced, k, 0)
        }
        if master_dtype != "float32":
            chunked["master_dtype"] = master_dtype
        if "n_persist" in forced and forced.get("n_chunk", 1) != 0:  # (a replayed unchunked plan has n_chunk 0)
            chunked["n_persist"] = _int_field(forced, "n_persist", 0)
        if chunked:
            raise ValueError(
                f"options['plan'] asks for {chunked}, but parameters are managed in chunks only when the model "
                "is trained with protrain_fx.optim.AdamW; create that optimizer before the first step"
            )
        return Plan(n_block=n_block, **activations)
    if size not in (4, layout.element_size) or size < layout.element_size:
        raise ValueError(
            f"options['plan']['master_dtype']={master_dtype!r} is for parameters of that dtype, and this model's "
            f"have {layout.element_size} bytes an element: use 'float32' (the default; 'float64' for a float64 "
            "model, which is its default)"
        )
    n_persist = _int_field(forced, "n_persist", layout.n_chunk)
    if n_persist > layout.n_chunk:
        raise ValueError(f"options['plan']['n_persist']={n_persist} exceeds the model's {layout.n_chunk} chunks")
    n_buffer = _int_field(forced, "n_buffer", 0 if n_persist == layout.n_chunk else min(2, layout.n_chunk - n_persist))
    if n_persist < layout.n_chunk and n_buffer < 1:
        raise ValueError("options['plan']['n_buffer'] must be at least 1 when some chunks are not persistent")
    _check_buffers(n_buffer, layout.n_chunk)
    n_device_shard = _int_field(forced, "n_device_shard", 0)
    if n_device_shard > layout.n_chunk - n_persist:
        raise ValueError(
            f"options['plan']['n_device_shard']={n_device_shard} exceeds the {layout.n_chunk - n_persist} chunks after "
            "the persistent ones (n_chunk - n_persist)"
        )
    offloaded = layout.n_chunk - n_persist - n_device_shard
    n_clip_overlap = _int_field(forced, "n_clip_overlap", 0)
    if n_clip_overlap > offloaded:
        raise ValueError(
            f"options['plan']['n_clip_overlap']={n_clip_overlap} exceeds the {offloaded} offloaded chunks (n_chunk - "
            "n_persist - n_device_shard)"
        )
    slots = grad_slot_fields(forced, layout.n_chunk, n_persist, n_device_shard)
    host_grad_slots, device_grad_slots = slots["host_grad_slots"], slots["device_grad_slots"]
    return Plan(
        n_persist=n_persist,
        n_buffer=n_buffer,
        n_device_shard=n_device_shard,
        n_chunk=layout.n_chunk,
        n_block=n_block,
        chunk_bytes=layout.chunk_bytes,
        n_clip_overlap=n_clip_overlap,
        host_grad_slots=host_grad_slots,
        device_grad_slots=device_grad_slots,
        master_dtype=master_dtype,
        **activations,
    )


def interleaved_modes(n_block: int, n_swap: int, n_checkpoint: int, n_selective: int = 0) -> tuple[str, ...]:
    """The paper's interleaved block layout (§3.2, Figure "interleaved block management"), with selective blocks:
    the first n_swap + n_checkpoint + n_selective blocks are optimized, swap blocks spread evenly among them
    starting with the first (so swapping starts early and overlaps the most compute, and the blocks between
    swaps keep activations from piling up while a swap is in flight), the others checkpointed first, then
    selective (the earlier a block, the longer its activations are held: the largest savings go there); the
    remaining blocks, last, keep their activations.
    8 blocks, 2 swap, 4 checkpoint: swap, checkpoint, checkpoint, swap, checkpoint, checkpoint, none, none.
    8 blocks, 2 swap, 2 checkpoint, 2 selective: swap, checkpoint, checkpoint, swap, selective, selective, none,
    none."""
    optimized = n_swap + n_checkpoint + n_selective
    assert optimized <= n_block, f"{optimized} optimized blocks exceed the {n_block} blocks"
    swaps = {optimized * i // n_swap for i in range(n_swap)} if n_swap else set()
    modes, recomputed = [], 0
    for i in range(n_block):
        if i in swaps:
            modes.append("swap")
        elif i < optimized:
            modes.append("checkpoint" if recomputed < n_checkpoint else "selective")
            recomputed += 1
        else:
            modes.append("none")
    return tuple(modes)


def _block_modes(n_block: int, forced: Mapping[str, Any]) -> tuple[str, ...]:
    """The per-block modes: forced `block_modes`, else the interleaved layout of the forced counts."""
    counts = {k: _int_field(forced, k, 0) for k in MODE_COUNTS}
    if "block_modes" in forced:
        modes = tuple(forced["block_modes"])
        bad = [m for m in modes if m not in BLOCK_MODES]
        if bad:
            raise ValueError(f"options['plan']['block_modes'] has unknown mode(s) {bad}; modes are {list(BLOCK_MODES)}")
        if len(modes) != n_block:
            raise ValueError(
                f"options['plan']['block_modes'] has {len(modes)} entries but the model has {n_block} blocks"
            )
        for key, mode in MODE_COUNTS.items():
            if key in forced and counts[key] != modes.count(mode):
                raise ValueError(
                    f"options['plan'][{key!r}]={counts[key]} disagrees with block_modes, which has "
                    f"{modes.count(mode)} {mode!r} blocks; give one or the other"
                )
        return modes
    if sum(counts.values()) > n_block:
        asked = " and ".join(f"{k}={counts[k]}" for k in MODE_COUNTS if counts[k])
        raise ValueError(
            f"options['plan'] asks for {asked}, more than the model's {n_block} blocks; lower them to sum to at "
            f"most {n_block}"
        )
    return interleaved_modes(n_block, counts["n_swap"], counts["n_checkpoint"], counts["n_selective"])
