"""RequestStats: how long each operation took and which errors were answered (for metrics).

Recorded by the handlers on the control thread (two clock reads and a few increments per
request); read as plain data by stats. Buckets are cumulative-free counts per bound."""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

# upper bounds (seconds) of the latency buckets; the last bucket is +Inf
BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0)


class RequestStats:
    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}  # op -> requests per bucket (len(BUCKETS) + 1)
        self.sums: Counter[str] = Counter()  # op -> seconds
        self.errors: Counter[str] = Counter()  # error code name -> replies

    def record(self, op: str, seconds: float) -> None:
        counts = self.counts.get(op)
        if counts is None:
            counts = self.counts[op] = [0] * (len(BUCKETS) + 1)
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sums[op] += seconds

    def error(self, code: str) -> None:
        self.errors[code] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "op_latency": {
                op: {"buckets": list(c), "sum": self.sums[op]} for op, c in self.counts.items()
            },
            "errors_by_code": dict(self.errors),
        }
