"""Breaker: stop asking a store that keeps failing, and probe it again later.

closed --``failures`` StoreDown in a row--> open (every call skipped) --cooldown--> half-open
(one call goes through: success closes, failure opens again with twice the cooldown, at most
``MAX_COOLDOWN_S``). Used by the L3 IO thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MAX_COOLDOWN_S = 60.0


class Breaker:
    def __init__(
        self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.failures = failures
        self.base_cooldown = self.cooldown = cooldown_s
        self.clock = clock
        self.in_a_row = 0
        self.open_until = 0.0  # > 0: open (or half-open once passed)
        self.opened = 0  # times it opened

    @property
    def state(self) -> str:
        if not self.open_until:
            return "closed"
        return "open" if self.clock() < self.open_until else "half_open"

    def allow(self) -> bool:
        """Whether a call may go to the store now."""
        return not self.open_until or self.clock() >= self.open_until

    def success(self) -> None:
        self.in_a_row, self.open_until, self.cooldown = 0, 0.0, self.base_cooldown

    def failure(self) -> None:
        self.in_a_row += 1
        if self.open_until:  # a failed probe: longer
            self.cooldown = min(MAX_COOLDOWN_S, self.cooldown * 2)
            self.open_until = self.clock() + self.cooldown
        elif self.in_a_row >= self.failures:
            self.open_until = self.clock() + self.cooldown
            self.opened += 1
