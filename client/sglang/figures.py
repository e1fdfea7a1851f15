"""StoreFigures: what SGLang's storage metrics read from the backend (``get_stats()``): pages
per get and per set, and their bandwidth (GB/s, copies included), since the last read. Any
thread (one lock inside)."""

from __future__ import annotations

import threading
import time
from typing import Any

MAX_SAMPLES = 4096  # per-call figures kept between two reads


class StoreFigures:
    def __init__(self, page_bytes: int = 0) -> None:
        self.page_bytes = page_bytes  # one page (set once the host pool is known)
        self._lock = threading.Lock()
        self._pages: dict[str, list[int]] = {"get": [], "set": []}
        self._gbps: dict[str, list[float]] = {"get": [], "set": []}

    def sample(self, op: str, count: int, start: float) -> None:
        """A ``get`` or ``set`` of ``count`` pages that began at ``start`` (perf_counter)."""
        if not count:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        with self._lock:
            if len(self._pages[op]) < MAX_SAMPLES:
                self._pages[op].append(count)
                self._gbps[op].append(count * self.page_bytes / seconds / 1e9)

    def take(self) -> Any:
        """SGLang's StorageMetrics of what was sampled since the last take."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            pages, gbps = self._pages, self._gbps
            self._pages, self._gbps = {"get": [], "set": []}, {"get": [], "set": []}
        return StorageMetrics(
            prefetch_pgs=pages["get"],
            backup_pgs=pages["set"],
            prefetch_bandwidth=gbps["get"],
            backup_bandwidth=gbps["set"],
        )
