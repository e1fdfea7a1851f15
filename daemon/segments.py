"""Names of the daemon's shared-memory segments, and removal of those a dead daemon left.

A segment is named ``hicache-<uid>-<pid>-<token>-<pool>`` in /dev/shm: the uid keeps users
apart, the pid tells whether its creator still runs, the random token makes each daemon
instance unique even when a pid is reused.
"""

from __future__ import annotations

import contextlib
import os
import secrets

from hicache.backing import SHM_DIR

PREFIX = "hicache"


def instance_token() -> str:
    return secrets.token_hex(4)


def segment_name(pool: str, token: str, pid: int | None = None) -> str:
    return f"{PREFIX}-{os.getuid()}-{pid or os.getpid()}-{token}-{pool}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink this user's segments whose creating daemon is gone; returns their names."""
    mine = f"{PREFIX}-{os.getuid()}-"
    removed = []
    for name in os.listdir(directory):
        if not name.startswith(mine):
            continue
        try:
            pid = int(name[len(mine) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            with contextlib.suppress(FileNotFoundError):  # another cleaner got there first
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed
