"""The rates of a step's copies and host work at each moment, set by what else runs then: copies over the host link
beside copies the other way and the host's AdamW (`Link`), the host's AdamW beside copies (`HostRates`). The
timelines (planner/timeline.py) lay a step out with them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from protrain_fx.profiler.hardware import HardwareProfile


class HostRates:
    """The host AdamW's seconds per parameter over time, set by which copies run then (`h2d`, `d2h`: their
    (start, end) seconds); they share the host's memory bandwidth with it (HardwareProfile.host_adam_s)."""

    def __init__(
        self,
        hardware: HardwareProfile,
        h2d: list[tuple[float, float]],
        d2h: list[tuple[float, float]],
        master_bytes: int = 4,
    ):
        events = sorted(
            (t, delta, way)
            for way, spans in enumerate((h2d, d2h))
            for a, b in spans
            if b > a
            for t, delta in ((a, 1), (b, -1))
        )
        self.starts, self.rates, running = [-math.inf], [hardware.host_adam_s(False, False, master_bytes)], [0, 0]
        for t, delta, way in events:
            running[way] += delta
            rate = hardware.host_adam_s(running[0] > 0, running[1] > 0, master_bytes)
            if t == self.starts[-1]:
                self.rates[-1] = rate
            else:
                self.starts.append(t)
                self.rates.append(rate)

    def end(self, start: float, params: float) -> float:
        """When the AdamW of `params` parameters begun at `start` ends."""
        k, t = bisect.bisect_right(self.starts, start) - 1, start
        while True:
            until = self.starts[k + 1] if k + 1 < len(self.starts) else math.inf
            if t + params * self.rates[k] <= until:
                return t + params * self.rates[k]
            params -= (until - t) / self.rates[k]
            t, k = until, k + 1


def step_clock(forward: dict, backward: dict, next_forward: float) -> dict[str, list[tuple[float, float]]]:
    """The (start, end) spans of the copies of the timelines `forward` and `backward` (planner/timeline.py), per way,
    on the step's clock: from the backward's start, where the next forward starts at `next_forward`."""
    return {
        way: backward[way] + [(next_forward + a, next_forward + b) for a, b in forward[way]] for way in ("h2d", "d2h")
    }


class _Busy:
    """When something runs: the union of (start, end) spans, asked whether it runs at a moment."""

    def __init__(self, spans: Sequence[tuple[float, float]]):
        self.starts: list[float] = []
        self.ends: list[float] = []
        for a, b in sorted(s for s in spans if s[1] > s[0]):
            if self.ends and a <= self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], b)
            else:
                self.starts.append(a)
                self.ends.append(b)

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and t < self.ends[i]

    def next_change(self, t: float) -> float:
        """The first moment after `t` at which whether something runs changes (inf: none)."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and t < self.ends[i]:
            return self.ends[i]
        return self.starts[i + 1] if i + 1 < len(self.starts) else math.inf


class Link:
    """Copy times over the host link: a copy runs at each moment at the rate measured beside what runs then
    (HardwareProfile.link_bytes_per_s), as an earlier pass of the step's timelines found it: copies the other
    way (`forward`, `backward`: those timelines), the host's AdamW (`host`: its busy spans), both or neither;
    on the step's clock (`step_clock`). Without an earlier pass every copy runs at the idle rate. (At the rate
    where it starts alone, a shift of a fraction of a millisecond across a span's edge would change a copy's whole
    time: two profiles of one model would predict apart.)"""

    def __init__(
        self,
        hardware: HardwareProfile,
        forward: dict | None = None,
        backward: dict | None = None,
        host: Sequence[tuple[float, float]] = (),
        next_forward: float = 0.0,
    ):
        self.hardware, self.host, self.next_forward = hardware, _Busy(host), next_forward
        no_copies: dict[str, list[tuple[float, float]]] = {"h2d": [], "d2h": []}
        spans = step_clock(forward or no_copies, backward or no_copies, next_forward)
        self.busy = {way: _Busy(spans[way]) for way in spans}

    def seconds(self, way: str, nbytes: float, start: float, *, forward: bool = False) -> float:
        """Seconds to copy `nbytes` to the device (`way` "h2d") or to the host ("d2h"), starting at `start` of the
        backward, or of the next `forward`."""
        if not nbytes:
            return 0.0
        at = start + self.next_forward if forward else start
        other, t, left = self.busy["d2h" if way == "h2d" else "h2d"], at, float(nbytes)
        while True:
            rate = self.hardware.link_bytes_per_s(way, t in other, t in self.host)
            until = min(other.next_change(t), self.host.next_change(t))
            if t + left / rate <= until:
                return t + left / rate - at
            left, t = left - (until - t) * rate, until

    def copy(self, way: str, nbytes: float, start: float, spans: list, *, forward: bool = False) -> float:
        """When a copy begun at `start` ends (as `seconds`), its (start, end) added to a timeline's `spans`."""
        end = start + self.seconds(way, nbytes, start, forward=forward)
        spans.append((start, end))
        return end
