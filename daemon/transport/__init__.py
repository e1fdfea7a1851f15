"""The control socket's transport: what reads it and in which order (inbox, busy poll), the tcp
connections' watch, and the endpoint's claim, admin token and bind addresses.

Names are imported on first use; nothing outside this package imports its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "LOCAL_USER": "hicache.daemon.transport.inbox",
    "USER_SHARE": "hicache.daemon.transport.wire_watch",
    "AdminToken": "hicache.daemon.transport.endpoint",
    "BusyPoll": "hicache.daemon.transport.busy_poll",
    "EndpointClaim": "hicache.daemon.transport.endpoint",
    "EndpointError": "hicache.daemon.transport.endpoint",
    "HANDSHAKE_BYTES": "hicache.daemon.transport.wire_watch",
    "IN_ALL": "hicache.daemon.transport.wire_watch",
    "Inbox": "hicache.daemon.transport.inbox",
    "MAX_CONNECTIONS": "hicache.daemon.transport.wire_watch",
    "PER_CONNECTION": "hicache.daemon.transport.wire_watch",
    "SPARE_DESCRIPTORS": "hicache.daemon.transport.wire_watch",
    "WireWatch": "hicache.daemon.transport.wire_watch",
    "bind_address": "hicache.daemon.transport.endpoint",
    "check_folder": "hicache.daemon.transport.endpoint",
    "connections_allowed": "hicache.daemon.transport.wire_watch",
    "peer_pid": "hicache.daemon.transport.inbox",
    "process_alive": "hicache.daemon.transport.inbox",
    "process_of": "hicache.daemon.transport.inbox",
    "raise_descriptor_limit": "hicache.daemon.transport.wire_watch",
    "watch": "hicache.daemon.transport.busy_poll",
}
__all__ = [
    "LOCAL_USER",
    "USER_SHARE",
    "AdminToken",
    "BusyPoll",
    "EndpointClaim",
    "EndpointError",
    "HANDSHAKE_BYTES",
    "IN_ALL",
    "Inbox",
    "MAX_CONNECTIONS",
    "PER_CONNECTION",
    "SPARE_DESCRIPTORS",
    "WireWatch",
    "bind_address",
    "check_folder",
    "connections_allowed",
    "peer_pid",
    "process_alive",
    "process_of",
    "raise_descriptor_limit",
    "watch",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.daemon.transport.busy_poll import BusyPoll, watch
    from hicache.daemon.transport.endpoint import (
        AdminToken,
        EndpointClaim,
        EndpointError,
        bind_address,
        check_folder,
    )
    from hicache.daemon.transport.inbox import (
        LOCAL_USER,
        Inbox,
        peer_pid,
        process_alive,
        process_of,
    )
    from hicache.daemon.transport.wire_watch import (
        HANDSHAKE_BYTES,
        IN_ALL,
        MAX_CONNECTIONS,
        PER_CONNECTION,
        SPARE_DESCRIPTORS,
        USER_SHARE,
        WireWatch,
        connections_allowed,
        raise_descriptor_limit,
    )
