"""What outlives a daemon process: the host tier's snapshots and kept pools, shared-memory segment
names and instance locks, and the reaper that frees a dead daemon's pools.

Names are imported on first use; nothing outside this package imports its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "HOST": "hicache.daemon.keep.segments",
    "HostKeeper": "hicache.daemon.keep.snapshot",
    "InstanceLock": "hicache.daemon.keep.segments",
    "KEEP": "hicache.daemon.keep.segments",
    "LOCK": "hicache.daemon.keep.segments",
    "instance_alive": "hicache.daemon.keep.segments",
    "instance_token": "hicache.daemon.keep.segments",
    "kept_for": "hicache.daemon.keep.segments",
    "mark_kept": "hicache.daemon.keep.segments",
    "reap": "hicache.daemon.keep.reaper",
    "remove_stale": "hicache.daemon.keep.segments",
    "segment_name": "hicache.daemon.keep.segments",
    "snapshot_path": "hicache.daemon.keep.snapshot",
    "spawn": "hicache.daemon.keep.reaper",
}
__all__ = [
    "HOST",
    "HostKeeper",
    "InstanceLock",
    "KEEP",
    "LOCK",
    "instance_alive",
    "instance_token",
    "kept_for",
    "mark_kept",
    "reap",
    "remove_stale",
    "segment_name",
    "snapshot_path",
    "spawn",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.daemon.keep.reaper import reap, spawn
    from hicache.daemon.keep.segments import (
        HOST,
        KEEP,
        LOCK,
        InstanceLock,
        instance_alive,
        instance_token,
        kept_for,
        mark_kept,
        remove_stale,
        segment_name,
    )
    from hicache.daemon.keep.snapshot import HostKeeper, snapshot_path
