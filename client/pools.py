"""The daemon's pools and its layer-progress table, mapped into the engine process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.client.trust import segment_path
from hicache.config import HiCacheConfig
from hicache.memory import AttachedCudaIPC, AttachedSharedMemory, DevicePool, HostPool
from hicache.transfers import LayerProgress


@dataclass
class AttachedPools:
    """The daemon's pools mapped into this process (shared memory on the CPU)."""

    config: HiCacheConfig
    device: DevicePool
    host: HostPool | None

    def __getattr__(self, name: str) -> Any:  # k_buffer, v_buffer, kv_buffer, layers
        return getattr(self.device, name)

    def close(self) -> None:
        self.device.close()
        if self.host is not None:
            self.host.close()


def _shm(desc: dict, daemon_uid: int | None, trusted: frozenset[int]) -> AttachedSharedMemory:
    """A segment the daemon described: its name checked, the path built here, the file's
    owner checked when mapped (client/trust.py)."""
    owners = trusted if daemon_uid is None else {daemon_uid}
    return AttachedSharedMemory(segment_path(desc, daemon_uid, trusted), owners)


def attach_pools(
    cfg: HiCacheConfig, pools: dict, daemon_uid: int | None, trusted: frozenset[int]
) -> AttachedPools:
    """Map the pools a hello described (same memory as the daemon's, no copy)."""
    desc = pools["device"]
    backing = (
        AttachedCudaIPC(desc) if desc.get("kind") == "cuda_ipc" else _shm(desc, daemon_uid, trusted)
    )
    device = DevicePool(cfg, backing)
    host = pools.get("host")
    host_pool = HostPool(cfg, _shm(host, daemon_uid, trusted)) if host else None
    return AttachedPools(cfg, device, host_pool)


def attach_progress(
    desc: dict, num_layers: int, daemon_uid: int | None, trusted: frozenset[int]
) -> tuple[AttachedSharedMemory, LayerProgress]:
    """Map the daemon's layer-progress table (read with acquire loads, never written here)."""
    backing = _shm(desc, daemon_uid, trusted)
    words = backing.allocate(desc["capacity"] * 8, "layer progress").numpy().view(np.int64)
    return backing, LayerProgress(words, num_layers)
