"""hicache.client: the engine-side client library and the `hicache` CLI."""

from hicache.client.client import HiCacheClient
from hicache.client.connection import DaemonError, DaemonTimeout, EpochChanged
from hicache.client.pools import AttachedPools
from hicache.client.results import LoadTicket, Match
from hicache.progress import LoadFailed

__all__ = [
    "AttachedPools",
    "DaemonError",
    "DaemonTimeout",
    "EpochChanged",
    "HiCacheClient",
    "LoadFailed",
    "LoadTicket",
    "Match",
]
