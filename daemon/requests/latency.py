"""RequestStats: how long each operation took and which errors were answered (for metrics).

Recorded by the handlers on the control thread (two clock reads and a few increments per
request); read as plain data by stats."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hicache.observe import SECONDS, Histogram

BUCKETS = SECONDS  # upper bounds (seconds) of the latency buckets; the last one is +Inf


class RequestStats:
    def __init__(self) -> None:
        self.latency: dict[str, Histogram] = {}  # op -> its latency histogram
        self.errors: Counter[str] = Counter()  # error code name -> replies

    def record(self, op: str, seconds: float) -> None:
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = Histogram(SECONDS)
        h.observe(seconds)

    def error(self, code: str) -> None:
        self.errors[code] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "op_latency": {op: h.as_dict() for op, h in self.latency.items()},
            "errors_by_code": dict(self.errors),
        }
