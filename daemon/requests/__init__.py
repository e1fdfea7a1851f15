"""Request handling: decode a request, act on the cache for a session, encode the reply (Handlers,
the cache operations, the operator's (evict, flush), what the transport tells them, the third
tier's waits, the engine tier, the figures engines report, the capacity feed, request latency,
the integrity check of the sessions against the cache, TREE's reply).

Names are imported on first use; nothing outside this package imports its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "Call": "hicache.daemon.requests.context",
    "EngineTier": "hicache.daemon.requests.engine_tier",
    "Handlers": "hicache.daemon.requests.handlers",
    "IDLE_BUDGET_S": "hicache.daemon.requests.capacity_feed",
    "L3Waits": "hicache.daemon.requests.l3_waits",
    "TierNames": "hicache.daemon.requests.tier_names",
    "Transport": "hicache.daemon.requests.context",
    "ViewBudget": "hicache.daemon.requests.view_budget",
    "WAKE_ID": "hicache.daemon.requests.l3_waits",
    "printable": "hicache.daemon.requests.handlers",
}
__all__ = [
    "Call",
    "EngineTier",
    "Handlers",
    "IDLE_BUDGET_S",
    "L3Waits",
    "TierNames",
    "Transport",
    "ViewBudget",
    "WAKE_ID",
    "printable",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.daemon.requests.capacity_feed import IDLE_BUDGET_S
    from hicache.daemon.requests.context import Call, Transport
    from hicache.daemon.requests.engine_tier import EngineTier
    from hicache.daemon.requests.handlers import Handlers, printable
    from hicache.daemon.requests.l3_waits import WAKE_ID, L3Waits
    from hicache.daemon.requests.tier_names import TierNames
    from hicache.daemon.requests.view_budget import ViewBudget
