"""The scheduler's DaemonLink: the generic link (hicache/client/daemon_link.py) whose
registered session is described by a ``PoolRef``, what the workers map."""

from __future__ import annotations

import logging

from hicache.client.client import HiCacheClient
from hicache.client.daemon_link import DOWN, Unavailable
from hicache.client.daemon_link import DaemonLink as _Link
from hicache.client.vllm.meta import PoolRef

__all__ = ["DOWN", "DaemonLink", "Unavailable"]


class DaemonLink(_Link):
    log = logging.getLogger("hicache.vllm")  # routed to vLLM's log (connector.py)
    pool: PoolRef | None

    def pool_ref(self, client: HiCacheClient) -> PoolRef:
        info = client.info
        return PoolRef(
            info["boot_epoch"],
            dict(info["config"]),
            dict(info["pools"]),
            info["layout"],
            client.daemon_uid,
        )
