"""Give freed heap memory back to the system now and then (glibc's ``malloc_trim``).

Large request frames (a batch of long prompts, a fuzzer's 256 KiB frames) leave freed chunks
that glibc keeps in its arenas, so a daemon's RSS climbs to its high-water mark and stays
there even though nothing is held. The control loop calls ``maybe()`` from housekeeping and
when the socket is quiet; it trims at most every TRIM_EVERY_S (a few ms each time). A no-op
where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

TRIM_EVERY_S = 10.0


class MemoryTrim:
    def __init__(self) -> None:
        self.trims = 0  # how many times the heap was trimmed
        self._next = time.monotonic() + TRIM_EVERY_S
        self._trim: Callable[[int], object] | None
        try:
            self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # musl, macOS: nothing to do
            self._trim = None

    def maybe(self) -> None:
        if self._trim is None or time.monotonic() < self._next:
            return
        self._trim(0)
        self.trims += 1
        self._next = time.monotonic() + TRIM_EVERY_S
