"""Names of the daemon's shared-memory segments, and removal of those a dead daemon left.

A segment is named ``hicache-<uid>-<pid>-<token>-<pool>`` in /dev/shm: the uid keeps users
apart, the random token makes each daemon instance unique. Whether the instance still runs is
told by a lock, not by its pid: each daemon holds an exclusive ``flock`` on its
``...-<token>-lock`` file for its whole life. The kernel drops the lock when the process dies,
however it dies, and the lock means the same in every PID namespace that shares /dev/shm
(containers), where a pid would name another process or none (and pid 1 is always "alive").

A daemon that keeps its host tier across restarts (``keep_host``) also has a ``...-keep``
marker: when it is gone, its host segment stays for the next daemon on its endpoint to adopt
(daemon/snapshot.py) while the marker was touched within ``KEEP_TTL_S``; after that, or once
adopted, it goes like the rest.

/dev/shm is shared by every user, and anyone may create a file under a name of ours. So only
regular files this user owns count as ours: a planted file, link or FIFO is ignored (never
opened through, never waited on, never taken for a live daemon's lock), and every file is
opened without following a link or blocking and checked on the open descriptor (``open_own``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
import time

from hicache.endpoints import SHM_DIR

PREFIX = "hicache"
LOCK = "lock"  # the instance lock's pool name
KEEP = "keep"  # the marker: this instance's host segment may be adopted after it ends
HOST = "host"
KEEP_TTL_S = 24 * 3600.0  # a kept host segment nobody adopted within this goes


def instance_token() -> str:
    return secrets.token_hex(16)  # 128 bits: names other users cannot guess


def segment_name(pool: str, token: str, pid: int | None = None) -> str:
    return f"{PREFIX}-{os.getuid()}-{pid or os.getpid()}-{token}-{pool}"


class InstanceLock:
    """The flock that says this daemon instance is alive; taken before any segment exists."""

    def __init__(self, token: str, directory: str = SHM_DIR):
        self.path = os.path.join(directory, segment_name(LOCK, token))
        # born under a temporary name and renamed once locked: a cleaner never sees it unlocked
        tmp = f"{self.path}.{secrets.token_hex(4)}.tmp"
        self.fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.rename(tmp, self.path)

    def close(self) -> None:
        """Remove the lock file and release the lock (after the segments are gone)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)


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


def _is_own(path: str) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _instances(directory: str) -> dict[str, list[str]]:
    """This user's segment names grouped by instance (``<pid>-<token>``): regular files of
    ours only (another user may create files under our names)."""
    mine = f"{PREFIX}-{os.getuid()}-"
    groups: dict[str, list[str]] = {}
    for name in os.listdir(directory):
        if not name.startswith(mine) or name.endswith(".tmp"):
            continue
        parts = name[len(mine) :].split("-")
        if len(parts) == 3 and _is_own(os.path.join(directory, name)):
            groups.setdefault(f"{parts[0]}-{parts[1]}", []).append(name)
    return groups


def _kept(directory: str, instance: str, names: list[str]) -> set[str]:
    """The host segment and marker of a dead instance that asked to keep them: while the
    snapshot its marker names exists and the marker is younger than KEEP_TTL_S."""
    marker = f"{PREFIX}-{os.getuid()}-{instance}-{KEEP}"
    host = f"{PREFIX}-{os.getuid()}-{instance}-{HOST}"
    if marker not in names or host not in names:
        return set()
    fd = open_own(os.path.join(directory, marker))
    if fd is None:
        return set()
    try:
        with open(fd) as fh:
            age = time.time() - os.fstat(fd).st_mtime
            snapshot = fh.read(4096)
    except (OSError, UnicodeDecodeError):
        return set()
    if age >= KEEP_TTL_S or not snapshot or not os.path.exists(snapshot):
        return set()
    return {marker, host}


def parse_name(name: str) -> tuple[int, str, str] | None:
    """(uid, instance, pool) of a segment name of ours in form, else None."""
    parts = name.split("-")
    if len(parts) != 5 or parts[0] != PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1]), f"{parts[2]}-{parts[3]}", parts[4]


def instance_alive(instance: str, directory: str = SHM_DIR) -> bool:
    """Whether the daemon instance ``<pid>-<token>`` of this user still holds its lock."""
    fd = open_own(os.path.join(directory, f"{PREFIX}-{os.getuid()}-{instance}-{LOCK}"))
    if fd is None:  # none, or one another user planted (its flock proves nothing)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (drops the lock if we took it)
    return False


def kept_for(instance: str, directory: str = SHM_DIR) -> str | None:
    """The snapshot path a dead instance's keep marker names (None: no marker)."""
    fd = open_own(os.path.join(directory, f"{PREFIX}-{os.getuid()}-{instance}-{KEEP}"))
    if fd is None:
        return None
    try:
        with open(fd) as fh:
            return fh.read(4096)
    except (OSError, UnicodeDecodeError):
        return None


def mark_kept(token: str, snapshot: str, directory: str = SHM_DIR) -> str:
    """Create (or renew) this instance's keep marker, naming the snapshot that will say what
    its host segment holds; returns the marker's path. Written under a fresh private name and
    renamed over the marker: whatever another user planted there (a link to a file of ours, a
    FIFO) is replaced, never opened."""
    path = os.path.join(directory, segment_name(KEEP, token))
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    with open(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600), "w") as fh:
        fh.write(snapshot)
    os.rename(tmp, path)
    return path


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink this user's segments whose daemon is gone (its instance lock is free, or there is
    none); returns their names. Segments of a live daemon are never touched."""
    removed = []
    for instance, names in _instances(directory).items():
        lock_name = f"{PREFIX}-{os.getuid()}-{instance}-{LOCK}"
        fd = None
        if lock_name in names:
            fd = open_own(os.path.join(directory, lock_name), os.O_RDWR)
            if fd is None:  # its daemon just stopped and removed it
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # alive
                os.close(fd)
                continue
        kept = _kept(directory, instance, names)
        try:  # the lock file goes last: while we hold it, nobody else judges this instance
            for name in sorted(names, key=lambda n: n == lock_name):
                if name in kept:
                    continue
                with contextlib.suppress(FileNotFoundError, PermissionError):  # another
                    os.unlink(os.path.join(directory, name))  # cleaner got there first
                    removed.append(name)
        finally:
            if fd is not None:
                os.close(fd)
    return removed
