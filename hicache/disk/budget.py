"""WriteBudget: bytes a disk tier may write in any 24 hours (a drive's endurance is rated in
drive-writes per day). Counted per minute over the last day, by the wall clock so that the
count outlives the process (``dump``/``load``: the store saves it in its folder, so restarts
do not reset it); ``take`` refuses a write that would go past the budget, so the tier never
exceeds it. Not thread-safe."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable

DAY_S = 86_400.0
BUCKET_S = 60.0


class WriteBudget:
    def __init__(self, bytes_per_day: int, clock: Callable[[], float] = time.time):
        if bytes_per_day < 0:
            raise ValueError("disk: the write budget is a size >= 0")
        self.bytes_per_day = bytes_per_day
        self.clock = clock
        self._buckets: deque[list[float]] = deque()  # [start, bytes], oldest first
        self._used = 0  # bytes in the buckets
        self.refused = 0  # writes refused for the budget
        self.refused_bytes = 0

    def used(self) -> int:
        """Bytes written in the last 24 hours."""
        self._expire(self.clock())
        return self._used

    def left(self) -> int:
        return max(0, self.bytes_per_day - self.used())

    def take(self, size: int) -> bool:
        """Count a write of ``size`` bytes, or refuse it (False: counted as refused)."""
        now = self.clock()
        self._expire(now)
        if self._used + size > self.bytes_per_day:
            self.refused += 1
            self.refused_bytes += size
            return False
        if not self._buckets or now - self._buckets[-1][0] >= BUCKET_S:
            self._buckets.append([now, 0])
        self._buckets[-1][1] += size
        self._used += size
        return True

    def give_back(self, size: int) -> None:
        """A counted write that did not happen (the drive refused it)."""
        if self._buckets:
            self._buckets[-1][1] -= size
            self._used -= size

    def dump(self) -> str:
        """The last day's counts, as text for ``load``."""
        self._expire(self.clock())
        return json.dumps([[round(start, 3), int(size)] for start, size in self._buckets])

    def load(self, text: str) -> None:
        """Count the writes ``dump`` recorded (a process before this one: its last day). A
        record that does not parse is ignored (ValueError)."""
        try:
            buckets = [(float(start), int(size)) for start, size in json.loads(text)]
        except Exception as exc:  # (any shape: a record the user's tools damaged)
            raise ValueError(f"disk: the write budget's record does not parse: {exc}") from None
        now = self.clock()
        for start, size in sorted(buckets):
            if size > 0 and now - start < DAY_S + BUCKET_S:
                self._buckets.append([min(start, now), float(size)])
                self._used += size

    def _expire(self, now: float) -> None:
        # (a bucket stays a day past its end: no write leaves the window early)
        while self._buckets and now - self._buckets[0][0] >= DAY_S + BUCKET_S:
            self._used -= int(self._buckets.popleft()[1])
