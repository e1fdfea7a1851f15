"""hicache.client: the engine-side client library and the `hicache` CLI."""

from hicache.client.client import AttachedPools, HiCacheClient, Match
from hicache.client.connection import DaemonError, DaemonTimeout, EpochChanged

__all__ = [
    "AttachedPools",
    "DaemonError",
    "DaemonTimeout",
    "EpochChanged",
    "HiCacheClient",
    "Match",
]
