"""Cost figures the planner derives from the profile and the hardware profile (paper §4.3, Appendix A).

swap_interval: how many blocks of forward compute it takes to hide one block's swap-out copy,
    N_interval = ceil(max over blocks of (bytes the block saves / device-to-host bandwidth) / block forward time)
It is fixed before the search (paper line 231): a swap block's copy finishes within the next N_interval blocks,
and the backward prefetches a swapped block N_interval blocks ahead of its first use.
"""

from __future__ import annotations

import math

from protrain_fx.profiler.hardware import HardwareProfile
from protrain_fx.profiler.profile import GraphProfile


def swap_interval(profile: GraphProfile, hardware: HardwareProfile, *, uploads_share_link: bool) -> int:
    """The swap interval in blocks (at least 1). `uploads_share_link`: parameter chunks are uploaded during the
    forward, so the copies run at the bandwidth measured with both directions busy."""
    rate = hardware.d2h_concurrent_bytes_per_s if uploads_share_link else hardware.d2h_bytes_per_s
    ratios = [b.saved_bytes / rate / b.forward_s for b in profile.blocks if b.forward_s > 0]
    return max(1, math.ceil(max(ratios, default=1.0)))
