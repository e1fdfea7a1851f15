"""HostKeeper: restarts that keep the host tier (``--keep-host``, on by default).

A daemon that stops (SIGTERM, SIGINT) waits for its copies, writes a snapshot of the tree's
host part (hicache/host_snapshot.py: nodes, page ids, page checksums) beside its endpoint
(``PATH.snapshot`` for ``ipc://PATH``, else in the runtime folder), and leaves its host pool's
shared-memory segment in place; its ``keep`` marker (daemon/keep/segments.py) tells other daemons'
clean-ups to spare it. The next daemon on the same endpoint with the same KV shape and host
size renames that segment to its own (before any clean-up could judge it), maps it, and adopts
every node whose pages still verify: an upgrade keeps hours of warm cache. Clients see a new
epoch and re-attach, as after any restart; nothing they held carries over. Nothing is adopted
but what this user's dead daemon kept for this endpoint: the snapshot must be a private
regular file of ours, the segment a private file of ours of the pool's size whose daemon's
instance lock is free and whose keep marker names this snapshot (``claim``, ``_unfit``).

After a crash (SIGKILL) the segment stays too (its marker is written with each snapshot),
and the last periodic snapshot (every ``snapshot_seconds``) is adopted the same way: pages
reused since it was taken fail their checksums and are dropped, the rest is served. A daemon
that dies before its first snapshot has no marker: nothing of it can be adopted, and its
reaper frees its pools at once. Under ``verify_pages`` the
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
import glob
import logging
import os
import stat
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgpack

from hicache import host_snapshot
from hicache.cache import HiRadixCache
from hicache.config import HiCacheConfig
from hicache.daemon.keep.segments import (
    DEFAULT_GRACE_S,
    HOST,
    KEEP,
    instance_alive,
    mark_kept,
    parse_name,
    segment_name,
)
from hicache.endpoints import admin_token_path
from hicache.memory import (
    SHM_DIR,
    PageSums,
    SharedMemoryBacking,
    expired,
    own_name,
    read_marker,
)

log = logging.getLogger("hicache.daemon")
DISCARD_READ_BYTES = 1 << 26  # read to free what a snapshot names (larger: only the file goes)


def snapshot_path(endpoint: str) -> str:
    """Where the daemon of ``endpoint`` keeps its host snapshot (beside its admin token)."""
    return admin_token_path(endpoint)[: -len(".admin")] + ".snapshot"


class HostKeeper:
    def __init__(
        self,
        endpoint: str,
        token: str,
        every_s: float,
        directory: str = SHM_DIR,
        model: str | None = None,
        grace_s: float = DEFAULT_GRACE_S,
    ):
        self.path = snapshot_path(endpoint)
        self.endpoint = endpoint
        self.grace_s = grace_s  # a kept host pool waits this long for a successor
        self.model = model  # what the KV means, where the daemon knows it (the third tier's)
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
        A snapshot that does not fit is removed (its segment is left to the clean-up), unless
        it is not ours."""
        self._remove_temps()
        try:
            data = self._read(host_snapshot.max_bytes(config))
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 (a snapshot we cannot read is not adopted)
            log.warning("host snapshot %s unreadable (%s): starting cold", self.path, exc)
            self._remove_file()
            return None
        unfit = self._unfit(data, host_snapshot.identity(config, self.model))
        if unfit is not None:
            log.warning("host snapshot %s not adopted (%s): starting cold", self.path, unfit)
            self._remove_file()  # (the clean-up then frees a dead daemon's segment)
            return None
        self.found = data
        return os.path.join(self.directory, data["segment"])

    def _unfit(self, data: Any, want: dict[str, Any]) -> str | None:
        """Why the host segment a snapshot names is not to be adopted (None: it is). Only a
        segment of this user, whose daemon is dead and kept it for this endpoint, with the
        size and owner and mode our daemons give it, holding KV of ``want``'s identity."""
        if not isinstance(data, dict) or not isinstance(data.get("identity"), dict):
            return "it is not a host snapshot"
        if data["identity"] != want:
            had = data["identity"]
            diff = ", ".join(
                f"{k} {had.get(k)!r} then, {want.get(k)!r} now"
                for k in sorted(set(had) | set(want), key=str)
                if had.get(k) != want.get(k)
            )
            return f"it is of another host pool or model: {diff:.300}"
        segment = data.get("segment")
        parsed = parse_name(segment) if isinstance(segment, str) else None
        if parsed is None or parsed[2] != HOST or "/" in segment:  # type: ignore[operator]  # parsed: a str
            return f"it names no host segment: {segment!r:.80}"
        uid, instance, _ = parsed
        if uid != os.getuid():
            return f"{segment} is uid {uid}'s"
        if instance_alive(instance, self.directory):
            return f"the daemon of {segment} is running"
        marker = read_marker(os.path.join(self.directory, own_name(instance, KEEP)))
        if marker is None or marker.snapshot != self.path:
            return f"the daemon of {segment} did not keep it for this endpoint"
        if expired(marker):  # (its reaper frees it, or the clean-up after this claim would)
            return f"{segment} was kept until {time.ctime(marker.until)}: its grace time is over"
        try:
            st = os.lstat(os.path.join(self.directory, str(segment)))
        except FileNotFoundError:
            return f"{segment} is gone"
        nbytes = max(int(want["host_bytes"]), 1)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return f"{segment} is not a private file of this user"
        if st.st_size != nbytes:
            return f"{segment} is {st.st_size} bytes, not {nbytes}"
        return None

    def _read(self, limit: int) -> Any:
        """The snapshot file's content, if it is a regular file of ours of at most ``limit``
        bytes (a FIFO, a symlink, another user's file: ValueError or OSError)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with open(fd, "rb") as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ValueError(f"not private to this user (uid {st.st_uid}, mode {st.st_mode:o})")
            if st.st_size > limit:
                raise ValueError(f"{st.st_size} bytes: larger than any snapshot of this pool")
            return msgpack.unpackb(fh.read(limit + 1), strict_map_key=False)

    def restore(self, cache: HiRadixCache, host: SharedMemoryBacking) -> int:
        """Adopt what the claimed snapshot names and still verifies, and write down at once what
        was adopted (a crash from here on keeps it). Returns the tokens adopted."""
        data, self.found = self.found, None
        if data is None:
            return 0
        t0 = time.perf_counter()
        adopted = dropped = 0
        try:
            restored = host_snapshot.restore(cache, data, self.model)
            adopted, dropped = restored.adopted, restored.dropped
        except Exception as exc:  # noqa: BLE001 (a snapshot that is not one: cold, not dead)
            log.warning("host snapshot not adopted: %s", exc)
        log.info(
            "adopted %d host tokens from the last daemon (%d dropped: changed or orphaned) in "
            "%.2f s",
            adopted,
            dropped,
            time.perf_counter() - t0,
        )
        with contextlib.suppress(FileNotFoundError):  # the last daemon's marker
            os.unlink(os.path.join(self.directory, str(data["segment"])[: -len(HOST)] + KEEP))
        if adopted:
            restored.snapshot["segment"] = host.name
            try:
                self._write_file(restored.snapshot)  # replaces the last daemon's
            except OSError as exc:
                log.warning("host snapshot not written: %s", exc)
                self._remove_file()
        else:
            self._remove_file()
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
        if cache.config.verify_pages:  # (the host tier's sums are kept up to date)
            self.write(cache, host)
            return
        if self._page_sums is None:
            self._page_sums = host_snapshot.summer(cache)
        host_snapshot.watch_frees(cache)
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
        freed, listing = host_snapshot.unwatch_frees(cache), self._listing
        self._job, self._listing = None, None
        if job.exception() is not None:
            log.error("host snapshot failed: %s", job.exception())
            return
        assert listing is not None  # (made with the job)
        data = host_snapshot.seal(cache, listing, freed, self.model)
        data["segment"] = host.name
        self._writing = self._worker().submit(self._write_file, data)

    def write(self, cache: HiRadixCache, host: SharedMemoryBacking) -> None:
        """Write the snapshot of ``cache``'s host part now (atomically, 0600), after whatever
        the worker was doing; touch the marker. Raises what the write raises."""
        self.wait(cache)
        self.next_at = time.monotonic() + self.every_s
        data = host_snapshot.take(cache, self.model)
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
                host_snapshot.unwatch_frees(cache)
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
        """Write ``data`` to the snapshot path atomically (a private temporary file of an
        unguessable name, renamed over it); touch the marker."""
        folder, name = os.path.split(self.path)
        fd, tmp = tempfile.mkstemp(prefix=f"{name}.", suffix=".tmp", dir=folder)  # 0600, O_EXCL
        try:
            with open(fd, "wb") as fh:
                fh.write(msgpack.packb(data))
            self._mark()  # (before the snapshot is there: a crash between keeps the last one)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.written += 1

    def discard_previous(self) -> None:
        """Free what the endpoint's last daemon kept (this one will not adopt it): the snapshot
        file, and the segment it names if that is a dead daemon's of this user."""
        self._remove_temps()
        try:
            data = self._read(DISCARD_READ_BYTES)
        except FileNotFoundError:
            return
        except Exception:  # noqa: BLE001 (unreadable: the file goes, the clean-up does the rest)
            data = None
        log.info("freeing the host tier the last daemon on this endpoint kept")
        segment = data.get("segment") if isinstance(data, dict) else None
        parsed = parse_name(segment) if isinstance(segment, str) else None
        self._remove_file()
        if parsed is None:
            return
        assert isinstance(segment, str)  # (parsed from it)
        if parsed[0] != os.getuid() or parsed[2] != HOST or "/" in segment:
            return
        if instance_alive(parsed[1], self.directory):
            return
        for pool in (KEEP, HOST):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, segment[: -len(HOST)] + pool))

    def _mark(self) -> None:
        mark_kept(self.token, self.path, self.directory, self.grace_s, self.endpoint)

    def forget(self) -> None:
        """This daemon keeps nothing (a failed start): remove its keep marker."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, segment_name(KEEP, self.token)))

    def _remove_file(self) -> None:
        """Remove the snapshot file if it is ours (never another user's, nor what a symlink
        points to)."""
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.path).st_uid == os.geteuid():
                os.unlink(self.path)

    def _remove_temps(self) -> None:
        """Temporary snapshot files of ours that a killed daemon left behind."""
        for tmp in glob.glob(glob.escape(self.path) + ".*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(tmp)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    os.unlink(tmp)
