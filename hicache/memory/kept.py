"""Host pools that stopped daemons kept for their successors: names, markers, listing, freeing.

A daemon's shared-memory files are ``hicache-<uid>-<pid>-<token>-<pool>`` in /dev/shm (pools
``device``, ``host``, ``progress``; ``lock``: the flock that says the daemon lives; ``keep``:
the marker that its host pool may be adopted once it is gone). A keep marker holds the snapshot
that says what the pool holds, the grace time after which nobody may adopt it any more, and the
endpoint it was kept for:

    /run/hicache/hicache.sock.snapshot
    grace 120
    endpoint ipc:///run/hicache/hicache.sock

A pool is kept until the marker's last write plus the grace: then the daemon's reaper process
(daemon/keep/reaper.py), or any later daemon's clean-up, or ``hicache kept --free`` removes it. Only
regular files of this user count (another user may create files under our names in the shared
/dev/shm): opened without following a link or blocking, checked on the open descriptor.

Shared by the daemon and the ``hicache`` CLI: the standard library only (no torch).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from dataclasses import dataclass

from hicache.endpoints import SHM_DIR

PREFIX = "hicache"
LOCK = "lock"  # the instance lock's pool name
KEEP = "keep"  # the marker: this instance's host segment may be adopted after it ends
HOST = "host"
DEFAULT_GRACE_S = 120.0  # how long a stopped daemon's host pool waits for a successor
MAX_GRACE_S = 86400.0  # what keep_host_seconds allows: a marker saying more is not ours


def own_name(instance: str, pool: str) -> str:
    """The file name of ``pool`` of this user's daemon instance ``<pid>-<token>``."""
    return f"{PREFIX}-{os.getuid()}-{instance}-{pool}"


def parse_name(name: str) -> tuple[int, str, str] | None:
    """(uid, instance, pool) of a segment name of ours in form, else None."""
    parts = name.split("-")
    if len(parts) != 5 or parts[0] != PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1]), f"{parts[2]}-{parts[3]}", parts[4]


def open_own(path: str, flags: int = os.O_RDONLY) -> int | None:
    """A descriptor of ``path`` if it is a regular file of this user (else None): opened
    without following a link and without blocking (a FIFO), then checked on what was opened."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone, a link (ELOOP), not ours to open
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        return fd
    os.close(fd)
    return None


def instance_alive(instance: str, directory: str = SHM_DIR) -> bool:
    """Whether the daemon instance ``<pid>-<token>`` of this user still holds its lock (a lock
    file another user planted proves nothing: it is not ours)."""
    fd = open_own(os.path.join(directory, own_name(instance, LOCK)))
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (drops the lock if we took it)
    return False


@dataclass(frozen=True)
class Marker:
    snapshot: str  # the snapshot file that says what the host pool holds
    grace_s: float  # kept this long after the marker's last write
    endpoint: str  # the endpoint the pool was kept for ("" when an older daemon wrote it)
    written: float  # the marker's last write (time.time())

    @property
    def until(self) -> float:
        return self.written + self.grace_s


def write_marker(
    path: str, snapshot: str, grace_s: float = DEFAULT_GRACE_S, endpoint: str = ""
) -> None:
    """Create (or renew) a keep marker: written under a fresh private name and renamed over
    ``path``, so that whatever another user planted there (a link to a file of ours, a FIFO) is
    replaced, never opened."""
    tmp = f"{path}.{os.urandom(4).hex()}.tmp"
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
    with open(os.open(tmp, flags, 0o600), "w") as fh:
        fh.write(f"{snapshot}\ngrace {grace_s:g}\nendpoint {endpoint}\n")
    os.rename(tmp, path)


def read_marker(path: str) -> Marker | None:
    """The marker at ``path`` (None: none, not ours, or not a marker)."""
    fd = open_own(path)
    if fd is None:
        return None
    try:
        with open(fd) as fh:
            written = os.fstat(fd).st_mtime
            lines = fh.read(8192).split("\n")
    except (OSError, UnicodeDecodeError):
        return None
    fields = dict(line.partition(" ")[::2] for line in lines[1:] if line)
    try:
        grace = float(fields.get("grace", 24 * 3600.0))  # (a day: what older markers meant)
    except ValueError:
        return None
    if not lines[0] or not 0 <= grace <= MAX_GRACE_S:  # (nan and inf fail too)
        return None
    return Marker(lines[0], grace, fields.get("endpoint", ""), written)


@dataclass(frozen=True)
class KeptPool:
    instance: str  # the stopped daemon's <pid>-<token>
    host: str  # the host pool's file
    nbytes: int
    marker: Marker


def names_snapshot(marker: Marker) -> bool:
    """Whether the snapshot ``marker`` names is there, a regular file of this user: only then
    can a successor adopt the pool (a daemon that died before its first snapshot kept
    nothing anyone could adopt, whatever its marker says)."""
    try:
        st = os.lstat(marker.snapshot)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def list_kept(directory: str = SHM_DIR) -> list[KeptPool]:
    """The host pools this user's stopped daemons kept (a live daemon's marker is not listed:
    it is kept only once that daemon stops)."""
    out = []
    mine = f"{PREFIX}-{os.getuid()}-"
    for name in sorted(os.listdir(directory)):
        parsed = parse_name(name)
        if not name.startswith(mine) or parsed is None or parsed[2] != KEEP:
            continue
        instance = parsed[1]
        marker = read_marker(os.path.join(directory, name))
        host = os.path.join(directory, own_name(instance, HOST))
        fd = open_own(host)
        if marker is None or fd is None or not names_snapshot(marker):
            if fd is not None:
                os.close(fd)
            continue
        nbytes = os.fstat(fd).st_size
        os.close(fd)
        if not instance_alive(instance, directory):
            out.append(KeptPool(instance, host, nbytes, marker))
    return out


def free_kept(pool: KeptPool, directory: str = SHM_DIR) -> None:
    """Remove a kept pool: its host file, its marker and its snapshot (ours only)."""
    for path in (pool.host, os.path.join(directory, own_name(pool.instance, KEEP))):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(pool.marker.snapshot)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(pool.marker.snapshot)


def expired(marker: Marker, now: float | None = None) -> bool:
    return (time.time() if now is None else now) >= marker.until
