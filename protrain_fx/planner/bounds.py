"""Lower bounds of a configuration's step time, at a fraction of the timelines' cost: the search (planner/search.py)
times configurations in the order of these and stops once they pass the times it can still use. Methods of
`CostModel` (planner/cost.py), which holds the fields they read.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from protrain_fx.planner.link import Link

if TYPE_CHECKING:
    from protrain_fx.planner.cost import Candidate, ModeTerms
    from protrain_fx.planner.cost_fields import CostFields
else:
    CostFields = object  # (planner/cost_fields.py: the type checker's view of CostModel)


def _plus_step_offset(bound):
    """A bound as its body computes it plus the calibrated time outside the phases that `step_s` adds to every plan
    (`CostModel.step_offset_s`)."""

    @functools.wraps(bound)
    def with_offset(self, *args, **kwargs) -> float:
        return bound(self, *args, **kwargs) + self.step_offset_s

    return with_offset


class StepBounds(CostFields):
    """Lower bounds of `Timeline.step_s`: a base of `CostModel`, whose fields and timelines these read."""

    @_plus_step_offset
    def step_floor_s(
        self,
        config: Candidate,
        terms: ModeTerms | None = None,
        *,
        host_scales: Sequence[float] = (1.0,),
        clip_weight: float = 0.0,
    ) -> float:
        """A lower bound of `step_bound_s(config)`, so of `step_s`, in a few operations (no copy laid out). The
        forward takes no less than its compute, the uploads of the chunks it loads one after another (each at least
        its time alone) and the swap-out copies; the backward no less than its compute (recompute included) and the
        uploads and swap-in copies that share the link to the device; the device's AdamW adds its part not hidden
        (`_gpu_optim_s`). The host's AdamW of the offloaded chunks runs at its fastest rate from the landing of
        the first gradient (the last chunk's backward and its copy) on, and the next forward's upload of the chunk
        last stepped and the last chunk's forward follow it. On the CPU, where nothing overlaps, they all add.
        `host_scales`: the mean of the bounds with the host's work that many times as long
        (`HardwareProfile.host_slower`). `clip_weight`: that share of the bound is one of the step whose clip
        applies, the host as profiled (`step_s(config, clipped=0)`), whose device AdamW adds all its time after
        the backward and whose host AdamW starts only then."""
        if terms is None or (self.n_chunk and terms.per_chunk is None):
            terms = self.mode_terms(config)
        forward = sum(self.other_fwd_s) + sum(self.block_fwd_s)
        backward = sum(self.other_bwd_s) + sum(self.block_bwd_s) + terms.recompute_s
        if self.n_chunk == 0:
            return forward + backward
        hw, per, load = self.hardware, terms.per_chunk, self._load_floor_s()
        assert per is not None, "mode_terms(config) splits the work per chunk where there are chunks"
        # (a chunk sharded on the device loads with its all-gather alone; the backward loads again the lowest
        # chunks beyond the buffers, those first)
        host = config.n_persist + config.n_device_shard
        offloaded, gathered = self.n_chunk - host, self.n_chunk - config.n_persist
        again = max(0, gathered - max(1, config.n_buffer))
        gather = self._gather_s()[0]
        uploads = (
            offloaded * load + config.n_device_shard * gather,
            again * gather + max(0, offloaded - max(1, config.n_buffer)) * (load - gather),
        )
        swapped = (terms.swapped_bytes / hw.d2h_bytes_per_s, terms.swapped_bytes / hw.h2d_bytes_per_s)
        work = sum(self.chunk_params[host:]) / self.world_size * self._host_floor_s()
        if not self.overlap:  # (the device's AdamW adds all its time, clipped or not)
            devices = forward + backward + sum(uploads) + sum(swapped) + self._gpu_optim_s(config)
            return devices + work * ((1 - clip_weight) * sum(host_scales) / len(host_scales) + clip_weight)
        forward, backward = max(forward, uploads[0], swapped[0]), max(backward, uploads[1] + swapped[1])
        devices = forward + backward + self._gpu_optim_s(config)
        waits = load + per["forward"][-1]  # (the next forward's, after the host's last update)
        unclipped = devices
        if offloaded:
            first = (
                per["backward"][-1] + per["recompute"][-1] + self.shard_elems * self.master_bytes / hw.d2h_bytes_per_s
            )
            unclipped = sum(max(devices, first + work * s + waits) for s in host_scales) / len(host_scales)
        if not clip_weight:
            return unclipped
        # a step whose clip applies: the host's AdamW starts after the backward and the device's (all of its time)
        clipped = backward + self._gpu_optim_s(config, early=False) + max(forward, work + waits if offloaded else 0.0)
        return (1 - clip_weight) * unclipped + clip_weight * clipped

    @_plus_step_offset
    def step_bound_s(
        self,
        config: Candidate,
        terms: ModeTerms | None = None,
        *,
        host_scales: Sequence[float] = (1.0,),
        clip_weight: float = 0.0,
    ) -> float:
        """A lower bound of `step_s(config)` at a fraction of its cost: the first pass of the timelines alone
        (every copy at its idle rate, which no copy beats beside other work); and the host's AdamW at its fastest
        rate, each chunk's once its gradient has landed as that pass has it, which the next forward's upload of the
        chunk last stepped and the last chunk's compute follow (on the CPU, where nothing overlaps, it adds).
        `host_scales`: the mean of the bounds with the host's work that many times as long (the first pass does
        not depend on it). `clip_weight`: that share of the bound is one of the step whose clip applies, the host
        as profiled (`step_s(config, clipped=0)`): the device's AdamW adds all its time after the backward (which
        ends no sooner than that pass has it), the host's starts only then, and the next forward's upload of the
        chunk last stepped and the last chunk's compute follow it (on the CPU the host's work adds, as unclipped)."""
        if self.n_chunk == 0:  # (no chunk: nothing waits for a clip; the offset is added back)
            return self.step_s(config) - self.step_offset_s
        per = self._per_chunk(config, terms.per_chunk if terms is not None else None)
        link = Link(self.hardware)
        forward, backward = self._forward_timeline(config, per, link), self._backward_timeline(config, per, link)
        bound = forward["end"] + backward["end"] + self._gpu_optim_s(config)
        offloaded = range(config.n_persist + config.n_device_shard, self.n_chunk)
        bounds = []
        for scale in host_scales:
            rate = self._host_floor_s() * scale / self.world_size
            if not self.overlap:
                bounds.append(bound + sum(self.chunk_params[c] for c in offloaded) * rate)
                continue
            host = 0.0  # the host's last update ends no sooner than one keeping busy from each gradient's landing
            for c in sorted(offloaded, key=backward["copy_end"].__getitem__):
                host = max(host, backward["copy_end"][c]) + self.chunk_params[c] * rate
            bounds.append(max(bound, host + self._load_floor_s() + per["forward"][-1]) if offloaded else bound)
        unclipped = sum(bounds) / len(bounds)
        if not clip_weight:
            return unclipped
        work = sum(self.chunk_params[c] for c in offloaded) * self._host_floor_s() / self.world_size
        before = backward["end"] + self._gpu_optim_s(config, early=False)
        if not self.overlap:
            clipped = forward["end"] + before + work
        elif offloaded:
            clipped = before + max(forward["end"], work + self._load_floor_s() + per["forward"][-1])
        else:
            clipped = before + forward["end"]
        return (1 - clip_weight) * unclipped + clip_weight * clipped

    def _load_floor_s(self) -> float:
        """The least seconds of an offloaded chunk's load: its shard up at the link's rate alone, the all-gather."""
        return self.shard_elems * self.master_bytes / self.hardware.h2d_bytes_per_s + self._gather_s()[0]

    def _host_floor_s(self) -> float:
        """The host AdamW's least seconds per parameter, beside whichever copies."""
        hw = self.hardware
        return min(hw.host_adam_s(h2d, d2h, self.master_bytes) for h2d in (False, True) for d2h in (False, True))
