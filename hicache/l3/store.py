"""The interface every L3 store implements, and ``open_store`` that picks one by URL.

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


class L3Store(ABC):
    """A batch key-value store for whole pages. One thread calls it at a time."""

    url: str = ""  # where it is, for messages and stats (no credentials)
    read_chunk_bytes: int = 0  # pages per get, in bytes, when the caller checks them (0: its own)

    def attach(self, pages: PageSegments) -> None:
        """The host pool whose pages ``put`` reads and ``get`` writes (called once, before any
        put or get)."""
        self.pages = pages

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key is stored (a hint: a later get may still miss)."""

    @abstractmethod
    def put(self, keys: list[str], pages: list[int], trailers: list[bytes]) -> list[bool]:
        """Store host page ``pages[i]`` followed by ``trailers[i]`` under ``keys[i]``. A key
        that is already stored counts as stored (values under one key are the same bytes)."""

    @abstractmethod
    def get(self, keys: list[str], pages: list[int], check: Check | None = None) -> list[Got]:
        """Read each key's page bytes into page ``pages[i]``; its trailer, or None for a miss
        (then the page's bytes are undefined). The caller verifies the trailers. A store that
        holds a value's bytes in one buffer before copying them (Redis) may instead call
        ``check(i, page_bytes, trailer)`` there, while they are hot in the cache, and return
        its verdict (True, or False: then the page is not written)."""

    def remove(self, keys: list[str]) -> None:
        """Drop values that failed to verify, so the next write of those pages puts them again
        (best effort: a failure here is ignored)."""

    def describe(self) -> dict[str, Any]:
        """Store-specific figures for stats (nodes, segment sizes). Called from another thread
        than the calls: it reads fields only, never the client."""
        return {}

    def close(self) -> None:
        """Release connections and registrations; idempotent."""


def check_url(url: str) -> str:
    """``url`` if its scheme and addresses are well formed (nothing is contacted); else
    ValueError naming the problem."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ValueError(f"l3: {url!r} is not SCHEME://ADDRESS (memory, redis, mooncake)")
    if scheme == "redis":
        parse_hosts(rest)
    elif scheme == "mooncake":
        parse_hosts(rest, at_most=1)
    elif scheme == "memory":
        from hicache.l3.memory import parse_faults

        parse_faults(rest.partition("?")[2])
    else:
        raise ValueError(f"l3: unknown store {scheme!r} in {url!r} (memory, redis, mooncake)")
    return url


# bytes per get of a store whose values land in the pool zero-copy (Mooncake): their checks run
# on a second thread while the next get reads, so only the last chunk's checks wait
ZERO_COPY_READ_BYTES = 16 << 20


class LazyStore(L3Store):
    """A store opened on first use, on the thread that uses it, and opened again after it
    failed to open: a daemon starts, and keeps serving, while its store is down (every call
    meanwhile raises StoreDown, a miss)."""

    def __init__(self, url: str, **options: Any):
        self.url = check_url(url)
        self.read_chunk_bytes = ZERO_COPY_READ_BYTES if url.startswith("mooncake://") else 0
        self.options = options
        self.inner: L3Store | None = None

    def _store(self) -> L3Store:
        if self.inner is None:
            try:
                store = open_store(self.url, **self.options)
            except StoreDown:
                raise
            except Exception as exc:  # a client library's own error: the store is down
                raise StoreDown(f"{self.url}: {type(exc).__name__}: {exc}") from None
            try:
                store.attach(self.pages)
            except BaseException:
                store.close()
                raise
            self.inner = store
        return self.inner

    def exists(self, keys: list[str]) -> list[bool]:
        return self._store().exists(keys)

    def put(self, keys: list[str], pages: list[int], trailers: list[bytes]) -> list[bool]:
        return self._store().put(keys, pages, trailers)

    def get(self, keys: list[str], pages: list[int], check: Check | None = None) -> list[Got]:
        return self._store().get(keys, pages, check)

    def remove(self, keys: list[str]) -> None:
        self._store().remove(keys)

    def describe(self) -> dict[str, Any]:
        inner = self.inner
        return {"connected": inner is not None, **(inner.describe() if inner else {})}

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None


def open_store(url: str, **options: Any) -> L3Store:
    """The store at ``url``: ``memory://NAME``, ``redis://HOST:PORT[,HOST:PORT...]`` (a Redis
    Cluster, or one server) or ``mooncake://HOST:PORT`` (a Mooncake master). Raises
    ValueError for an unknown scheme or bad address, StoreDown when it cannot be reached."""
    check_url(url)
    scheme, _, rest = url.partition("://")
    if scheme == "memory":
        from hicache.l3.memory import MemoryStore

        return MemoryStore(rest, **options)  # (NAME?latency_s=X: faults for tests)
    if scheme == "redis":
        from hicache.l3.redis_store import RedisStore

        return RedisStore(parse_hosts(rest), **options)
    if scheme == "mooncake":
        from hicache.l3.mooncake import MooncakeStore

        (master,) = parse_hosts(rest, at_most=1)
        return MooncakeStore(master, **options)
    raise AssertionError(scheme)  # (check_url knows every scheme)


def parse_hosts(text: str, at_most: int = 64) -> list[tuple[str, int]]:
    """``host:port[,host:port...]`` -> [(host, port)]; ValueError naming the bad part."""
    out = []
    for part in text.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"l3: {part!r} is not HOST:PORT")
        out.append((host, int(port)))
    if not 0 < len(out) <= at_most:
        raise ValueError(f"l3: expected 1 to {at_most} HOST:PORT, got {text!r}")
    return out
