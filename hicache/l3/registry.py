"""Which store a URL names, and a store opened on first use: the registry of the third tier's
stores, apart from their interface (``store.py``), so that the interface imports none of them.

``memory://NAME`` (``memory.py``), ``redis://HOST:PORT[,...]`` (``redis_store.py``),
``mooncake://HOST:PORT`` (``mooncake.py``) and ``disk:///PATH[,PATH...]?bytes=SIZE`` (the
node's own drives: ``disk_store.py`` over ``hicache.disk``): each implementation, and its
client library, is imported only when a URL names it.
"""

from __future__ import annotations

from typing import Any

from hicache.l3.store import ZERO_COPY_READ_BYTES, Check, Got, L3Store, Parents, StoreDown


def check_url(url: str) -> str:
    """``url`` if its scheme and addresses are well formed (nothing is contacted); else
    ValueError naming the problem."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ValueError(f"l3: {url!r} is not SCHEME://ADDRESS (memory, redis, mooncake, disk)")
    if scheme == "redis":
        parse_hosts(rest)
    elif scheme == "mooncake":
        parse_hosts(rest, at_most=1)
    elif scheme == "memory":
        from hicache.l3.memory import parse_faults

        parse_faults(rest.partition("?")[2])
    elif scheme == "disk":
        from hicache.disk.url import parse_disk_url

        parse_disk_url(rest)
    else:
        raise ValueError(f"l3: unknown store {scheme!r} in {url!r} (memory, redis, mooncake, disk)")
    return url


class LazyStore(L3Store):
    """A store opened on first use, on the thread that uses it, and opened again after it
    failed to open: a daemon starts, and keeps serving, while its store is down (every call
    meanwhile raises StoreDown, a miss)."""

    def __init__(self, url: str, **options: Any):
        self.url = check_url(url)
        self.read_chunk_bytes = ZERO_COPY_READ_BYTES if url.startswith("mooncake://") else 0
        # a disk (alone, or over the store): its rules hold before it is opened
        self.keeps_prefixes = self.clears = url.startswith("disk://") or bool(options.get("disk"))
        self.reads_at_once = url.startswith("disk://")  # (not the disk over a remote store)
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

    def put(
        self, keys: list[str], pages: list[int], trailers: list[bytes], parents: Parents = None
    ) -> list[bool]:
        return self._store().put(keys, pages, trailers, parents)

    def get(
        self, keys: list[str], pages: list[int], check: Check | None = None, parents: Parents = None
    ) -> list[Got]:
        return self._store().get(keys, pages, check, parents)

    def remove(self, keys: list[str]) -> None:
        self._store().remove(keys)

    def clear(self) -> int:
        return self._store().clear()

    def evict(self, count: int) -> int:
        return self._store().evict(count)

    def dropped(self) -> list[str]:
        return self.inner.dropped() if self.inner is not None else []

    def local(self, keys: list[str]) -> list[bool]:
        return self.inner.local(keys) if self.inner is not None else [False] * len(keys)

    def tick(self) -> None:
        if self.inner is not None:  # (never opens it)
            self.inner.tick()

    def describe(self) -> dict[str, Any]:
        inner = self.inner
        return {"connected": inner is not None, **(inner.describe() if inner else {})}

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None


def open_store(url: str, disk: Any = None, **options: Any) -> L3Store:
    """The store at ``url``: ``memory://NAME``, ``redis://HOST:PORT[,HOST:PORT...]`` (a Redis
    Cluster, or one server), ``mooncake://HOST:PORT`` (a Mooncake master) or
    ``disk:///PATH[,PATH...]?bytes=SIZE`` (this node's drives); with ``disk`` (a
    ``hicache.disk.url.DiskUrl``: ``--disk`` with ``--l3``), this node's disk over that store.
    Raises ValueError for an unknown scheme or bad address, StoreDown when it cannot be
    reached."""
    check_url(url)
    if disk is not None:  # (--disk with --l3: this node's disk over the store)
        from hicache.l3.disk_store import DiskAbove, DiskStore

        above = DiskStore(disk.paths, disk.capacity_bytes, disk.budget_bytes_per_day)
        return DiskAbove(above, open_store(url, **options))
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
    if scheme == "disk":
        from hicache.disk.url import parse_disk_url
        from hicache.l3.disk_store import DiskStore

        where = parse_disk_url(rest)
        return DiskStore(where.paths, where.capacity_bytes, where.budget_bytes_per_day, **options)
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
