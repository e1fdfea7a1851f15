"""The interface every L3 store implements (``registry.py`` picks one by URL).

A store holds values under string keys (``keys.py``); a value is one host page's bytes followed
by its trailer (``pages.py``). Stores move bytes straight between the host pool and the store
where they can (Mooncake registers the pool) and through one copy where they cannot (Redis).

Calls are batched and synchronous: the L3 tier calls them from its own IO thread, never from
the daemon's control loop. A key that cannot be written or read is ``False``/``None`` in the
result (a miss); ``StoreDown`` means nothing in the call could be done (the store, or every
node asked, is unreachable). A store never raises anything else for a store-side failure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from hicache.l3.pages import PageSegments


class StoreDown(Exception):
    """The store cannot be reached: every key of the call is a miss."""


Check = Callable[[int, memoryview, bytes], bool]  # (index, a value's page bytes, its trailer)
Got = bytes | bool | None  # a trailer to verify, a verdict of ``check``, or a miss
# each key's chain parent (the page before it; None: a prompt's first page), or None: unknown
Parents = list[str | None] | None


class L3Store(ABC):
    """A batch key-value store for whole pages. One thread calls it at a time."""

    url: str = ""  # where it is, for messages and stats (no credentials)
    # holds a key only with its chain parent (the disk): puts and gets are given ``parents``,
    # and a write whose first page's parent the store lacks is not made
    keeps_prefixes: bool = False
    clears: bool = False  # ``clear`` forgets what this node's store holds (the disk)
    read_chunk_bytes: int = 0  # pages per get, in bytes, when the caller checks them (0: its own)
    # a miss costs little to ask with pages set aside (a local drive): the tier allocates
    # free pages before asking, and the IO thread reads the hits in the same turn
    reads_at_once: bool = False

    def attach(self, pages: PageSegments) -> None:
        """The host pool whose pages ``put`` reads and ``get`` writes (called once, before any
        put or get)."""
        self.pages = pages

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key is stored (a hint: a later get may still miss)."""

    @abstractmethod
    def put(
        self, keys: list[str], pages: list[int], trailers: list[bytes], parents: Parents = None
    ) -> list[bool]:
        """Store host page ``pages[i]`` followed by ``trailers[i]`` under ``keys[i]``. A key
        that is already stored counts as stored (values under one key are the same bytes).
        ``parents`` (for a store that ``keeps_prefixes``): each key's chain parent."""

    @abstractmethod
    def get(
        self, keys: list[str], pages: list[int], check: Check | None = None, parents: Parents = None
    ) -> list[Got]:
        """Read each key's page bytes into page ``pages[i]``; its trailer, or None for a miss
        (then the page's bytes are undefined). The caller verifies the trailers. A store that
        holds a value's bytes in one buffer before copying them (Redis) may instead call
        ``check(i, page_bytes, trailer)`` there, while they are hot in the cache, and return
        its verdict (True, or False: then the page is not written). ``parents``: as for
        ``put`` (a store that keeps what it read on a faster level of its own)."""

    def remove(self, keys: list[str]) -> None:
        """Drop values that failed to verify, so the next write of those pages puts them again
        (best effort: a failure here is ignored)."""

    def dropped(self) -> list[str]:
        """Keys this node's own medium (the disk) let go since the last call: evicted to make
        room, or dropped with a prefix that failed to read (not a flush). Other stores: []."""
        return []

    def local(self, keys: list[str]) -> list[bool]:
        """Whether this node's own medium (the disk) holds each key, for KV events' STORAGE
        (a remote store's keys are never announced: all False)."""
        return [False] * len(keys)

    def tick(self) -> None:
        """Housekeeping: called by the IO thread when it has nothing else to do, about once
        a second (a disk syncs what it wrote a while ago)."""

    def clear(self) -> int:
        """Forget every value (an operator's flush), now and after a restart: how many were
        held. Only a store that ``clears`` (a shared remote store is never flushed from one
        node); OSError when it cannot."""
        raise NotImplementedError(f"{self.url}: not flushed from a daemon")

    def evict(self, count: int) -> int:
        """Let the ``count`` least recently used values go (an operator's eviction; a prefix
        after its tails): how many went. Only a store that ``clears``."""
        raise NotImplementedError(f"{self.url}: not evicted from a daemon")

    def describe(self) -> dict[str, Any]:
        """Store-specific figures for stats (nodes, segment sizes). Called from another thread
        than the calls: it reads fields only, never the client."""
        return {}

    def close(self) -> None:
        """Release connections and registrations; idempotent."""


# bytes per get of a store whose values land in the pool zero-copy (Mooncake): their checks run
# on a second thread while the next get reads, so only the last chunk's checks wait
ZERO_COPY_READ_BYTES = 16 << 20
