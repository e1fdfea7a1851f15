"""Names of the daemon's shared-memory segments, and removal of those a dead daemon left.

A segment is named ``hicache-<uid>-<pid>-<token>-<pool>`` in /dev/shm: the uid keeps users
apart, the random token makes each daemon instance unique. Whether the instance still runs is
told by a lock, not by its pid: each daemon holds an exclusive ``flock`` on its
``...-<token>-lock`` file for its whole life. The kernel drops the lock when the process dies,
however it dies, and the lock means the same in every PID namespace that shares /dev/shm
(containers), where a pid would name another process or none (and pid 1 is always "alive").

A daemon that keeps its host tier across restarts (``keep_host``) also has a ``...-keep``
marker (hicache/memory/kept.py): when it is gone, its host segment stays for the next daemon on its
endpoint to adopt (daemon/keep/snapshot.py) for the marker's grace time (``keep_host_seconds``);
after that its reaper (daemon/keep/reaper.py) or any later clean-up removes it, and once adopted it
goes like the rest.

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

from hicache.endpoints import SHM_DIR
from hicache.memory import (  # noqa: F401  (names of the files, shared with the CLI)
    DEFAULT_GRACE_S,
    HOST,
    KEEP,
    LOCK,
    PREFIX,
    expired,
    instance_alive,
    names_snapshot,
    open_own,
    own_name,
    parse_name,
    read_marker,
    write_marker,
)


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
    snapshot its marker names exists and the marker's grace time has not run out."""
    marker, host = own_name(instance, KEEP), own_name(instance, HOST)
    if marker not in names or host not in names:
        return set()
    kept = read_marker(os.path.join(directory, marker))
    if kept is None or expired(kept) or not names_snapshot(kept):
        return set()
    return {marker, host}


def kept_for(instance: str, directory: str = SHM_DIR) -> str | None:
    """The snapshot path a dead instance's keep marker names (None: no marker)."""
    kept = read_marker(os.path.join(directory, own_name(instance, KEEP)))
    return None if kept is None else kept.snapshot


def mark_kept(
    token: str,
    snapshot: str,
    directory: str = SHM_DIR,
    grace_s: float = DEFAULT_GRACE_S,
    endpoint: str = "",
) -> str:
    """Create (or renew) this instance's keep marker, naming the snapshot that will say what
    its host segment holds, how long it may wait for a successor and for which endpoint;
    returns the marker's path (hicache/memory/kept.py: never written through what was planted)."""
    path = os.path.join(directory, segment_name(KEEP, token))
    write_marker(path, snapshot, grace_s, endpoint)
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
