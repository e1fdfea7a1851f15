"""hicache.client: the engine-side client library and the `hicache` CLI.

Names are imported on first use: the CLI never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.kernels.shadowing import defer_to_installed
from hicache.lazy import lazy_exports

defer_to_installed(__name__, __file__)

_EXPORTS = {
    "HiCacheClient": "hicache.client.client",
    "Inserted": "hicache.client.client",
    "ClientClosed": "hicache.client.connection",
    "DaemonError": "hicache.client.connection",
    "DaemonTimeout": "hicache.client.connection",
    "EpochChanged": "hicache.client.connection",
    "LeaseLost": "hicache.client.connection",
    "LayoutMismatch": "hicache.client.connection",
    "NotOwned": "hicache.client.connection",
    "AttachedPools": "hicache.client.pools",
    "LoadTicket": "hicache.client.results",
    "Match": "hicache.client.results",
    "LoadFailed": "hicache.transfers",
}
__all__ = [
    "AttachedPools",
    "ClientClosed",
    "DaemonError",
    "DaemonTimeout",
    "EpochChanged",
    "HiCacheClient",
    "Inserted",
    "LayoutMismatch",
    "LeaseLost",
    "LoadFailed",
    "LoadTicket",
    "Match",
    "NotOwned",
]

if TYPE_CHECKING:
    from hicache.client.client import HiCacheClient, Inserted
    from hicache.client.connection import (
        ClientClosed,
        DaemonError,
        DaemonTimeout,
        EpochChanged,
        LayoutMismatch,
        LeaseLost,
        NotOwned,
    )
    from hicache.client.pools import AttachedPools
    from hicache.client.results import LoadTicket, Match
    from hicache.transfers import LoadFailed


__getattr__ = lazy_exports("hicache.client", _EXPORTS, globals())
