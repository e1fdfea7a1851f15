"""Engine sessions: the session table (leases, quarantine, who holds what) and the limits on what
one session may hold.

Names are imported on first use; nothing outside this package imports its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "Ended": "hicache.daemon.sessions.table",
    "LOCAL_USER": "hicache.daemon.sessions.table",
    "MAX_SESSIONS_PER_PEER": "hicache.daemon.sessions.table",
    "SNDHWM": "hicache.daemon.sessions.limits",
    "ServiceClock": "hicache.daemon.sessions.table",
    "Session": "hicache.daemon.sessions.table",
    "SessionLimits": "hicache.daemon.sessions.limits",
    "SessionTable": "hicache.daemon.sessions.table",
    "USER_SHARE": "hicache.daemon.sessions.table",
    "out_of_memory": "hicache.daemon.sessions.limits",
    "process_pid": "hicache.daemon.sessions.table",
}
__all__ = [
    "Ended",
    "LOCAL_USER",
    "MAX_SESSIONS_PER_PEER",
    "SNDHWM",
    "ServiceClock",
    "Session",
    "SessionLimits",
    "SessionTable",
    "USER_SHARE",
    "out_of_memory",
    "process_pid",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.daemon.sessions.limits import SNDHWM, SessionLimits, out_of_memory
    from hicache.daemon.sessions.table import (
        LOCAL_USER,
        MAX_SESSIONS_PER_PEER,
        USER_SHARE,
        Ended,
        ServiceClock,
        Session,
        SessionTable,
        process_pid,
    )
