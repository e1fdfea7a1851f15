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
periodic snapshot (every ``snapshot_seconds``, written only under ``verify_pages``, whose
maintained checksums make it cheap) is adopted the same way: pages reused since it was taken
fail their checksums and are dropped, the rest is served. Without ``verify_pages`` a crash
leaves nothing to adopt (only a clean stop computes the checksums).

Runs on the control thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import msgpack

from hicache import host_snapshot
from hicache.backing import SHM_DIR, SharedMemoryBacking
from hicache.cache import HiRadixCache
from hicache.config import HiCacheConfig
from hicache.daemon.segments import KEEP, mark_kept, segment_name
from hicache.endpoints import admin_token_path

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

    def due(self, cache: HiRadixCache) -> bool:
        """A periodic snapshot is due (only where checksums are maintained)."""
        return (
            self.every_s > 0
            and cache.engine is not None
            and cache.engine.sums is not None
            and time.monotonic() >= self.next_at
        )

    def write(self, cache: HiRadixCache, host: SharedMemoryBacking) -> None:
        """Write the snapshot of ``cache``'s host part (atomically, 0600); touch the marker."""
        self.next_at = time.monotonic() + self.every_s
        data = host_snapshot.take(cache)
        data["segment"] = host.name
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
