"""ViewBudget: the control loop's time for whole-cache views when others wait for it.

An integrity check (``STATS`` with ``check``) or a tree view (``TREE``) walks the whole cache on
the control loop, a stats report lists every session and a capacity report feeds the estimate
first, and every other client's request waits meanwhile. A view that made another
request wait is charged its time to a bucket that drains at ``share`` of real time; while the
bucket holds more than ``burst_s``, views of sessions that are not admin are refused
(``QUOTA_EXCEEDED``, saying when to retry). A view nobody waited for costs nothing, so one
client alone (a test, an operator's shell) is never refused; admin sessions (the hicache CLI)
never are. Control thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hicache.protocol import ErrorCode, ProtocolError

DEFAULT_SHARE = 0.005  # of the loop's time: views that delayed others take at most this, ...
DEFAULT_BURST_S = 0.02  # ... after a burst of this many seconds of them


class ViewBudget:
    def __init__(
        self,
        share: float = DEFAULT_SHARE,
        burst_s: float = DEFAULT_BURST_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.share = share
        self.burst_s = burst_s
        self.clock = clock
        self.debt = 0.0  # seconds of views that delayed others, not drained yet
        self.at = clock()  # when ``debt`` was last drained
        self.refused = 0  # views refused (stats: views_refused)

    def _drain(self) -> None:
        now = self.clock()
        self.debt = max(0.0, self.debt - (now - self.at) * self.share)
        self.at = now

    def check(self, view: str) -> None:
        """Refuse (QUOTA_EXCEEDED) while views have taken more than their share."""
        self._drain()
        over = self.debt - self.burst_s
        if over > 0:
            self.refused += 1
            raise ProtocolError(
                ErrorCode.QUOTA_EXCEEDED,
                f"{view} holds the daemon's loop while other clients wait: such views get "
                f"{self.share:.1%} of the daemon's time, retry in {over / self.share:.1f} s "
                "(an admin session, as the hicache CLI opens, is not limited)",
            )

    def charge(self, seconds: float, delayed_others: bool) -> None:
        """A view took ``seconds``; ``delayed_others``: a request waited for it meanwhile."""
        if delayed_others:
            self._drain()
            self.debt += seconds
