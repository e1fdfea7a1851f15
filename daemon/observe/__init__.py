"""What the daemon shows operators: Prometheus metrics, KV events, and the control loop's own
housekeeping figures (cycle collector pauses, memory given back).

Names are imported on first use; nothing outside this package imports its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "END_SEQ": "hicache.daemon.observe.events",
    "EventPublisher": "hicache.daemon.observe.events",
    "GcPauses": "hicache.daemon.observe.gc_pauses",
    "MAX_ASK_BYTES": "hicache.daemon.observe.events",
    "MAX_PEERS": "hicache.daemon.observe.events",
    "MemoryTrim": "hicache.daemon.observe.memory_trim",
    "MetricsServer": "hicache.daemon.observe.metrics",
    "PEER_SENDS": "hicache.daemon.observe.events",
    "families": "hicache.daemon.observe.metrics",
}
__all__ = [
    "END_SEQ",
    "EventPublisher",
    "GcPauses",
    "MAX_ASK_BYTES",
    "MAX_PEERS",
    "MemoryTrim",
    "MetricsServer",
    "PEER_SENDS",
    "families",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.daemon.observe.events import (
        END_SEQ,
        MAX_ASK_BYTES,
        MAX_PEERS,
        PEER_SENDS,
        EventPublisher,
    )
    from hicache.daemon.observe.gc_pauses import GcPauses
    from hicache.daemon.observe.memory_trim import MemoryTrim
    from hicache.daemon.observe.metrics import MetricsServer, families
