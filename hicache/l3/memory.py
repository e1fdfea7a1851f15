"""MemoryStore: an in-process store with injected faults, for tests and the demo.

Stores with the same name share one ``Space`` (a dict of values), so two caches in one process
(two "machines" in a test) see each other's pages. ``Faults`` makes it misbehave the ways real
stores do: latency, calls that fail, keys that exist but cannot be read, values that come
back corrupted, a node that is dead, and a capacity past which the oldest values are evicted.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from hicache.l3.store import Check, Got, L3Store, Parents, StoreDown


@dataclass
class Faults:
    """How a space misbehaves (change fields at any time; the next call sees them)."""

    latency_s: float = 0.0  # added to every call
    down: bool = False  # every call raises StoreDown
    fail_rate: float = 0.0  # a call raises StoreDown with this probability
    lose_rate: float = 0.0  # a get of a stored key misses with this probability
    corrupt: set[str] = field(default_factory=set)  # keys whose values come back with a bit flipped
    capacity: int | None = None  # values kept (least recently used go first)
    seed: int = 0


class Space:
    def __init__(self) -> None:
        self.values: OrderedDict[str, bytes] = OrderedDict()
        self.lock = threading.Lock()
        self.faults = Faults()
        self.rng = random.Random(0)
        self.calls = 0


_SPACES: dict[str, Space] = {}
_SPACES_LOCK = threading.Lock()


def space(name: str) -> Space:
    """The shared space behind every MemoryStore called ``name`` (created on first use)."""
    with _SPACES_LOCK:
        return _SPACES.setdefault(name, Space())


def drop_space(name: str) -> None:
    with _SPACES_LOCK:
        _SPACES.pop(name, None)


def parse_faults(query: str) -> dict[str, float]:
    """``latency_s=0.5&lose_rate=0.1`` -> faults; ValueError naming a bad one."""
    out = {}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        if key not in ("latency_s", "fail_rate", "lose_rate"):
            raise ValueError(f"l3: memory fault {key!r} (latency_s, fail_rate, lose_rate)")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not 0 <= number < math.inf:
            raise ValueError(f"l3: memory fault {key}={value!r} is not a number >= 0")
        out[key] = number
    return out


class MemoryStore(L3Store):
    def __init__(self, name: str, **_: object):
        """``name`` may carry faults for a daemon under test: ``NAME?latency_s=0.5&lose_rate=0.1``
        (float fields of Faults)."""
        name, _mark, query = name.partition("?")
        self.url = f"memory://{name}"
        self.space = space(name)
        for key, value in parse_faults(query).items():
            setattr(self.space.faults, key, value)

    def _enter(self) -> Faults:
        faults = self.space.faults
        if faults.latency_s:
            time.sleep(faults.latency_s)
        self.space.calls += 1
        if faults.down or (faults.fail_rate and self.space.rng.random() < faults.fail_rate):
            raise StoreDown(f"{self.url}: injected failure")
        return faults

    def exists(self, keys: list[str]) -> list[bool]:
        self._enter()
        with self.space.lock:
            return [k in self.space.values for k in keys]

    def put(
        self, keys: list[str], pages: list[int], trailers: list[bytes], parents: Parents = None
    ) -> list[bool]:
        faults = self._enter()
        values = [self.pages.read(p) + t for p, t in zip(pages, trailers, strict=True)]
        with self.space.lock:
            stored = self.space.values
            for key, value in zip(keys, values, strict=True):
                stored.setdefault(key, value)
                stored.move_to_end(key)
            while faults.capacity is not None and len(stored) > faults.capacity:
                stored.popitem(last=False)
        return [True] * len(keys)

    def get(
        self, keys: list[str], pages: list[int], check: Check | None = None, parents: Parents = None
    ) -> list[Got]:
        """(Trailers only: ``check`` is not used.)"""
        faults = self._enter()
        out: list[Got] = []
        for key, page in zip(keys, pages, strict=True):
            with self.space.lock:
                value = self.space.values.get(key)
                if value is not None:
                    self.space.values.move_to_end(key)
                lost = faults.lose_rate and self.space.rng.random() < faults.lose_rate
            if value is None or lost or len(value) != self.pages.page_bytes + 16:
                out.append(None)
                continue
            if key in faults.corrupt:
                flipped = bytearray(value)
                flipped[len(flipped) // 3] ^= 0x10
                value = bytes(flipped)
            self.pages.write(page, memoryview(value)[: self.pages.page_bytes])
            out.append(value[self.pages.page_bytes :])
        return out

    def remove(self, keys: list[str]) -> None:
        self._enter()
        with self.space.lock:
            for key in keys:
                self.space.values.pop(key, None)
                self.space.faults.corrupt.discard(key)

    def describe(self) -> dict[str, object]:
        return {"values": len(self.space.values), "calls": self.space.calls}
