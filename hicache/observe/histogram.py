"""Histogram: counts per bucket and a sum, for Prometheus histograms made from plain data.

Recorded on the control thread (a bisect and two increments); read as a dict by stats. The
buckets are per-bound counts, not cumulative (the metrics endpoint accumulates)."""

from __future__ import annotations

import bisect
from typing import Any

# upper bounds of latency buckets (seconds); the last bucket is +Inf
SECONDS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0)
# upper bounds of copy sizes (bytes): 4 KiB to 1 GiB by 4x
BYTES = tuple(float(4096 * 4**i) for i in range(10))


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = SECONDS):
        self.bounds = bounds  # upper bounds, increasing; one more bucket for +Inf
        self.counts = [0] * (len(bounds) + 1)  # observations per bucket
        self.sum = 0.0  # of every observation

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def as_dict(self) -> dict[str, Any]:
        return {"buckets": list(self.counts), "sum": self.sum, "bounds": list(self.bounds)}
