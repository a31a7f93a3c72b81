"""`CostFields`: `CostModel` (planner/cost.py) as the modules of its formulas see it, for the type checker.

The formulas are the methods of CostModel's bases, one module per question (memory_model.py, timeline.py,
bounds.py); each reads CostModel's fields and calls the others' methods. They declare CostFields as their base
where a type checker reads them (`if TYPE_CHECKING`), and `object` at run time, so that a field a formula misreads,
or a method it calls with the wrong arguments, is a type error, and CostModel must define all of them (a field it
lacks leaves it abstract). At run time nothing here exists: CostModel's fields and the bases' methods do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from protrain_fx.planner.cost import Candidate, ModeTerms
    from protrain_fx.planner.link import Link
    from protrain_fx.planner.memory_model import Segment
    from protrain_fx.planner.timeline import ChunkWork, ModeWork
    from protrain_fx.profiler.hardware import HardwareProfile


class CostFields(Protocol):
    """CostModel's fields (its docstring and comments say what each is) and the methods its bases call of each
    other."""

    n_block: int
    swap_interval: int
    block_fwd_s: tuple[float, ...]
    block_bwd_s: tuple[float, ...]
    block_saved: tuple[int, ...]
    block_output: tuple[int, ...]
    block_transient: tuple[int, ...]
    other_fwd_s: tuple[float, float]
    other_bwd_s: tuple[float, float]
    segments: tuple[Segment, ...]
    hardware: HardwareProfile
    alpha: float
    other_bytes: int
    n_chunk: int
    chunk_elems: int
    shard_elems: int
    element_size: int
    world_size: int
    block_chunk: tuple[int, ...]
    chunk_params: tuple[int, ...]
    shard_params: tuple[int, ...]
    regathers: tuple[tuple[int, int], ...]
    least_buffers: tuple[int, ...]
    forced_modes: tuple[str, ...]
    overlap: bool
    host_budget: int | None
    forced_grad_slots: int | None
    forced_device_grad_slots: int | None
    share_device_grads: bool
    timing_noise: float
    step_offset_s: float
    master_bytes: int
    backward_matmul_share: float
    matmul_stretch: float
    updates_wait: bool
    block_kept: tuple[int, ...]
    block_selective_s: tuple[float, ...]
    block_selective_transient: tuple[int, ...]
    block_saved_for_later: tuple[tuple[tuple[int, int], ...], ...]

    # cost.py
    def modes(self, config: Candidate) -> tuple[str, ...]: ...

    @property
    def prices_selective(self) -> bool: ...

    def recompute_s(self, block: int, mode: str) -> float: ...

    def mode_terms(self, config: Candidate, *, chunks: bool = True) -> ModeTerms: ...

    # memory_model.py
    def saving(self, block: int, mode: str) -> int: ...

    def activation_peak(self, modes: Sequence[str]) -> int: ...

    def grad_slots(self, config: Candidate) -> int: ...

    # timeline.py
    def step_s(self, config: Candidate, clipped: int | None = None) -> float: ...

    def _gather_s(self) -> tuple[float, float]: ...

    def _gpu_optim_s(
        self, config: Candidate, reduced: Sequence[float] | None = None, end: float = 0.0, *, early: bool = True
    ) -> float: ...

    def _per_chunk(self, config: Candidate, of_modes: ModeWork | None = None) -> ChunkWork: ...

    def _per_chunk_of_modes(self, config: Candidate) -> ModeWork: ...

    def _forward_timeline(
        self, config: Candidate, per: ChunkWork, link: Link, ready: Sequence[float] | None = None
    ) -> dict: ...

    def _backward_timeline(
        self, config: Candidate, per: ChunkWork, link: Link, host_ends: list | None = None
    ) -> dict: ...
