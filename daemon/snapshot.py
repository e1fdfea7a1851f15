"""HostKeeper: restarts that keep the host tier (``--keep-host``, on by default).

A daemon that stops (SIGTERM, SIGINT) waits for its copies, writes a snapshot of the tree's
host part (hicache/host_snapshot.py: nodes, page ids, page checksums) beside its endpoint
(``PATH.snapshot`` for ``ipc://PATH``, else in the runtime folder), and leaves its host pool's
shared-memory segment in place; its ``keep`` marker (daemon/segments.py) tells other daemons'
clean-ups to spare it. The next daemon on the same endpoint with the same KV shape and host
size renames that segment to its own (before any clean-up could judge it), maps it, and adopts
every node whose pages still verify: an upgrade keeps hours of warm cache. Clients see a new
epoch and re-attach, as after any restart; nothing they held carries over.

After a crash (SIGKILL) the segment stays too (its marker was made at start), and the last
periodic snapshot (every ``snapshot_seconds``) is adopted the same way: pages reused since it
was taken fail their checksums and are dropped, the rest is served. Under ``verify_pages`` the
checksums are maintained and a periodic snapshot is written at once; without it the nodes are
listed on the control thread and their pages summed on the keeper's own thread (the C helper
drops the GIL), so that reading a large pool does not stall requests; nodes whose pages were
freed meanwhile are left out (host_snapshot.seal), and the file is written on that thread too.

Runs on the control thread, but for what it hands its one worker thread (``_pool``): summing a
listing's pages (reads the host pool) and writing a snapshot file. ``close`` waits for both
before the host pool may go.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgpack

from hicache import host_snapshot
from hicache.backing import SHM_DIR, SharedMemoryBacking
from hicache.cache import HiRadixCache
from hicache.config import HiCacheConfig
from hicache.daemon.segments import KEEP, mark_kept, segment_name
from hicache.endpoints import admin_token_path
from hicache.page_sums import PageSums

log = logging.getLogger("hicache.daemon")
MAX_SNAPSHOT_BYTES = 1 << 32  # a larger file is not read (it is not ours to trust)


def snapshot_path(endpoint: str) -> str:
    """Where the daemon of ``endpoint`` keeps its host snapshot (beside its admin token)."""
    return admin_token_path(endpoint)[: -len(".admin")] + ".snapshot"


class HostKeeper:
    def __init__(self, endpoint: str, token: str, every_s: float, directory: str = SHM_DIR):
        self.path = snapshot_path(endpoint)
        self.token = token  # this daemon instance's
        self.every_s = every_s  # periodic snapshots (0: only at a clean stop)
        self.directory = directory
        self.found: dict[str, Any] | None = None  # the last daemon's snapshot, being adopted
        self.next_at = time.monotonic() + every_s
        self.written = 0  # snapshots written by this daemon
        self._pool: ThreadPoolExecutor | None = None  # sums pages, writes files (made on use)
        self._page_sums: PageSums | None = None  # sums the host pool's pages (no verify_pages)
        self._listing: host_snapshot.Listing | None = None  # being summed by _job
        self._job: Future | None = None  # sum_pages(_listing), in flight
        self._writing: Future | None = None  # the last snapshot file being written

    def claim(self, config: HiCacheConfig) -> str | None:
        """The last daemon's host segment to adopt (its path), if its snapshot fits ``config``;
        else None. Call with this instance's lock held and before stale segments are removed.
        A snapshot that does not fit is removed (its segment is left to the clean-up)."""
        mark_kept(self.token, self.path, self.directory)  # a crash keeps the host pool too
        try:
            if os.stat(self.path).st_size > MAX_SNAPSHOT_BYTES:
                raise ValueError("too large")
            with open(self.path, "rb") as fh:
                data = msgpack.unpackb(fh.read(), strict_map_key=False)
            segment = str(data["segment"])
            if "/" in segment or not segment.endswith("-host"):
                raise ValueError(f"segment {segment!r}")
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 (a snapshot we cannot read is not adopted)
            log.warning("host snapshot %s unreadable (%s): starting cold", self.path, exc)
            self._discard()
            return None
        want = host_snapshot.identity(config)
        path = os.path.join(self.directory, segment)
        if data.get("identity") != want or not os.path.exists(path):
            log.warning(
                "host snapshot %s is for another host pool or its memory is gone: starting cold",
                self.path,
            )
            self._discard(segment)  # the endpoint is ours: so is what its last daemon kept
            return None
        self.found = data
        return path

    def restore(self, cache: HiRadixCache) -> int:
        """Adopt what the claimed snapshot names and still verifies; then forget it. Returns
        the tokens adopted."""
        data, self.found = self.found, None
        if data is None:
            return 0
        t0 = time.perf_counter()
        try:
            adopted, dropped = host_snapshot.restore(cache, data)
        except ValueError as exc:
            log.warning("host snapshot not adopted: %s", exc)
            adopted, dropped = 0, 0
        log.info(
            "adopted %d host tokens from the last daemon (%d dropped: changed or orphaned) in "
            "%.2f s",
            adopted,
            dropped,
            time.perf_counter() - t0,
        )
        self._discard(str(data["segment"]), keep_segment=True)
        return adopted

    def due(self) -> bool:
        """A periodic snapshot is due (and none is in the works)."""
        return (
            self.every_s > 0
            and time.monotonic() >= self.next_at
            and self._job is None
            and (self._writing is None or self._writing.done())
        )

    def start(self, cache: HiRadixCache, host: SharedMemoryBacking) -> None:
        """Begin a periodic snapshot: written now under verify_pages, else listed now and
        summed in the background (``poll`` finishes it)."""
        self.next_at = time.monotonic() + self.every_s
        if cache.engine is not None and cache.engine.sums is not None:
            self.write(cache, host)
            return
        if self._page_sums is None:
            self._page_sums = PageSums(cache.host_pool.page_view)
        cache.host_alloc.watch_frees()
        self._listing = host_snapshot.list_host(cache)
        self._job = self._worker().submit(
            host_snapshot.sum_pages, cache, self._listing, self._page_sums
        )

    def poll(self, cache: HiRadixCache, host: SharedMemoryBacking) -> None:
        """Finish a background snapshot whose sums are in: seal it (nodes whose pages were
        freed meanwhile are left out) and hand the file to the worker."""
        job = self._job
        if job is None or not job.done():
            return
        freed, listing = cache.host_alloc.freed, self._listing
        self._job, self._listing = None, None
        cache.host_alloc.unwatch_frees()
        if job.exception() is not None:
            log.error("host snapshot failed: %s", job.exception())
            return
        data = host_snapshot.seal(cache, listing, freed)
        data["segment"] = host.name
        self._writing = self._worker().submit(self._write_file, data)

    def write(self, cache: HiRadixCache, host: SharedMemoryBacking) -> None:
        """Write the snapshot of ``cache``'s host part now (atomically, 0600), after whatever
        the worker was doing; touch the marker. Raises what the write raises."""
        self.wait(cache)
        self.next_at = time.monotonic() + self.every_s
        data = host_snapshot.take(cache)
        data["segment"] = host.name
        self._write_file(data)

    def wait(self, cache: HiRadixCache | None) -> None:
        """Let the worker finish (a snapshot being summed is abandoned): after this nothing
        reads the host pool or writes a snapshot but the control thread."""
        if self._job is not None:
            with contextlib.suppress(Exception):
                self._job.result()
            self._job = self._listing = None
            if cache is not None:
                cache.host_alloc.unwatch_frees()
        if self._writing is not None:
            try:
                self._writing.result()
            except Exception:  # noqa: BLE001 (the next snapshot replaces it)
                log.exception("host snapshot file not written")
            self._writing = None

    def close(self, cache: HiRadixCache | None) -> None:
        """Wait for the worker and stop it (before the host pool goes)."""
        self.wait(cache)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hicache-snapshot")
        return self._pool

    def _write_file(self, data: dict[str, Any]) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with open(fd, "wb") as fh:
            fh.write(msgpack.packb(data))
        os.replace(tmp, self.path)
        mark_kept(self.token, self.path, self.directory)
        self.written += 1

    def discard_previous(self) -> None:
        """Free what the endpoint's last daemon kept (this one will not adopt it)."""
        try:
            with open(self.path, "rb") as fh:
                segment = msgpack.unpackb(fh.read(MAX_SNAPSHOT_BYTES))["segment"]
        except FileNotFoundError:
            return
        except Exception:  # noqa: BLE001 (unreadable: the file goes, the clean-up does the rest)
            segment = None
        log.info("freeing the host tier the last daemon on this endpoint kept")
        self._discard(segment if isinstance(segment, str) else None)

    def forget(self) -> None:
        """This daemon keeps nothing (a failed start): remove its keep marker."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, segment_name(KEEP, self.token)))

    def _discard(self, segment: str | None = None, keep_segment: bool = False) -> None:
        """Remove the snapshot file, and the last daemon's marker (and its host segment, unless
        adopted) when ``segment`` names it."""
        names = [self.path]
        if segment is not None and "/" not in segment and segment.endswith("-host"):
            names.append(os.path.join(self.directory, segment[: -len("host")] + KEEP))
            if not keep_segment:
                names.append(os.path.join(self.directory, segment))
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
