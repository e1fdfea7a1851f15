"""Engine sessions: the session table (leases, quarantine, who holds what) and the limits on what
one session may hold.

Names are imported on first use; nothing outside this package imports its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "EngineCounts": "hicache.daemon.sessions.engine_counts",
    "SATURATED": "hicache.daemon.sessions.engine_counts",
    "reported": "hicache.daemon.sessions.engine_counts",
    "Ended": "hicache.daemon.sessions.table",
    "MAX_SESSIONS_PER_PEER": "hicache.daemon.sessions.table",
    "SNDHWM": "hicache.daemon.sessions.limits",
    "ServiceClock": "hicache.daemon.sessions.table",
    "Session": "hicache.daemon.sessions.table",
    "SessionLimits": "hicache.daemon.sessions.limits",
    "SessionTable": "hicache.daemon.sessions.table",
    "out_of_memory": "hicache.daemon.sessions.limits",
    "process_pid": "hicache.daemon.sessions.table",
}
__all__ = [
    "EngineCounts",
    "SATURATED",
    "reported",
    "Ended",
    "MAX_SESSIONS_PER_PEER",
    "SNDHWM",
    "ServiceClock",
    "Session",
    "SessionLimits",
    "SessionTable",
    "out_of_memory",
    "process_pid",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.daemon.sessions.engine_counts import SATURATED, EngineCounts, reported
    from hicache.daemon.sessions.limits import SNDHWM, SessionLimits, out_of_memory
    from hicache.daemon.sessions.table import (
        MAX_SESSIONS_PER_PEER,
        Ended,
        ServiceClock,
        Session,
        SessionTable,
        process_pid,
    )
