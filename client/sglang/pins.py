"""PinBook: the pages ``batch_exists`` found, pinned (locked in the daemon) for the get that
follows. Pure bookkeeping, no daemon calls: the backend releases what ``stale`` and ``drain``
hand back. Any thread (one lock inside)."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

from hicache.client.results import Match


@dataclass
class Pin:
    match: Match  # a locked one-page match
    generation: int  # the link's session it belongs to (its lock id means nothing in another)
    since: float  # monotonic time it was taken


class PinBook:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, list[Pin]] = defaultdict(list)  # a key may be pinned twice
        self._loose: list[Pin] = []  # found beyond an exists' leading run: for release

    def add(self, keys: list[str], matches: list[Match], generation: int, now: float) -> None:
        """Pins for ``keys`` (the leading run found); the matches after them, if locked, are
        loose (released with the next call)."""
        with self._lock:
            for key, m in zip(keys, matches, strict=False):
                self._by_key[key].append(Pin(m, generation, now))
            self._loose += [Pin(m, generation, now) for m in matches[len(keys) :] if m.lock_id]

    def take(self, keys: list[str], generation: int) -> list[Match | None]:
        """One pinned match per key (the oldest), None where none is pinned in ``generation``
        (a pin of an older session is void: dropped, never used)."""
        out: list[Match | None] = []
        with self._lock:
            for key in keys:
                mine = self._by_key.get(key)
                pin = mine.pop(0) if mine else None
                if mine == []:
                    del self._by_key[key]
                out.append(pin.match if pin is not None and pin.generation == generation else None)
        return out

    def stale(self, deadline: float) -> list[Pin]:
        """Removes and returns the loose pins and those taken before ``deadline``."""
        with self._lock:
            out, self._loose = self._loose, []
            for key in [k for k, pins in self._by_key.items() if pins[0].since < deadline]:
                pins = self._by_key[key]
                out += [p for p in pins if p.since < deadline]
                pins[:] = [p for p in pins if p.since >= deadline]
                if not pins:
                    del self._by_key[key]
        return out

    def drain(self) -> list[Pin]:
        """Removes and returns every pin."""
        with self._lock:
            out = [p for pins in self._by_key.values() for p in pins] + self._loose
            self._by_key.clear()
            self._loose = []
        return out

    def __len__(self) -> int:
        with self._lock:
            return sum(len(p) for p in self._by_key.values()) + len(self._loose)
