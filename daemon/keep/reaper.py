"""The reaper: gives a daemon's shared memory back once the daemon is gone and nobody adopted it.

Every daemon starts one (``spawn``), a small process of its own session that holds no pool and
no descriptor of the daemon's: it opens the daemon's instance lock and waits for it. When the
daemon ends, however it ends (a clean stop, SIGKILL, the OOM killer), the lock is free:

- nothing kept (no keep marker, or none whose snapshot is there: a daemon that died before its
  first snapshot): the instance's leftovers (a crash's pools) are removed, and the reaper
  exits;
- a host pool kept for a successor: what cannot be adopted (the device pool, the progress
  table, the lock) goes at once, and the host pool and its marker wait until the marker's
  grace time runs out. A daemon that adopts the pool renames it (the reaper sees it gone and
  exits); ``hicache kept --free`` removes it earlier; else at the deadline the reaper removes
  the pool, its marker and its snapshot, and exits.

So a stopped daemon's memory comes back within its grace time without counting on another
daemon. Imports the standard library only: ``python -m hicache.daemon.keep.reaper LOCK INSTANCE``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time

from hicache.memory import (
    HOST,
    KEEP,
    KeptPool,
    expired,
    free_kept,
    names_snapshot,
    own_name,
    read_marker,
)

POLL_S = 1.0  # how often a waiting reaper looks whether the pool was adopted or freed


def spawn(lock_path: str, instance: str) -> subprocess.Popen:
    """Start the reaper of the daemon that holds ``lock_path`` (call with the lock held). It
    inherits no descriptor (the lock's least of all) and outlives the daemon."""
    return subprocess.Popen(
        # -P and cwd /: the daemon's working folder (anyone's) is not on the import path
        [sys.executable, "-P", "-m", "hicache.daemon.keep.reaper", lock_path, instance],
        cwd="/",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=True,  # (a signal to the daemon's group does not reach it)
    )


def _remove_leftovers(directory: str, instance: str, spare: tuple[str, ...] = ()) -> None:
    """The instance's files that are ours (a crash's pools, a progress table, its lock, and
    what it was writing under a temporary name when it died: only the daemon writes its own
    files), but those named in ``spare``."""
    prefix = own_name(instance, "")
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(prefix) and name not in spare:
            with contextlib.suppress(FileNotFoundError, PermissionError):
                st = os.lstat(path)
                if st.st_uid == os.geteuid():
                    os.unlink(path)


def reap(lock_path: str, instance: str, directory: str) -> str:
    """Wait for the daemon to end, then give back what nobody adopts; returns what happened.
    A kept host pool (its marker names a snapshot that is there) waits for its successor
    until its grace time is over; everything else of the instance goes at once."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "no lock: the daemon is gone already"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # until the daemon ends
    finally:
        os.close(fd)  # (released at once: a lock we held would say the daemon lives)
    marker_path = os.path.join(directory, own_name(instance, KEEP))
    host = os.path.join(directory, own_name(instance, HOST))
    marker = read_marker(marker_path)
    if marker is None or not os.path.exists(host) or not names_snapshot(marker):
        _remove_leftovers(directory, instance)  # nothing a successor could adopt
        return "nothing kept"
    # only the host pool and its marker wait: the device pool, the progress table and the
    # lock cannot be adopted
    spare = (own_name(instance, HOST), own_name(instance, KEEP))
    _remove_leftovers(directory, instance, spare)
    while True:
        marker = read_marker(marker_path)
        if marker is None or not os.path.exists(host):
            _remove_leftovers(directory, instance)  # adopted (renamed) or freed meanwhile
            return "adopted or freed"
        if expired(marker) or not names_snapshot(marker):
            free_kept(KeptPool(instance, host, 0, marker), directory)
            _remove_leftovers(directory, instance)
            return "grace time over: freed"
        time.sleep(min(POLL_S, max(0.0, marker.until - time.time())))


if __name__ == "__main__":
    from hicache.endpoints import SHM_DIR

    reap(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else SHM_DIR)
