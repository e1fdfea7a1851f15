"""CacheStats: a frozen snapshot of the cache's sizes and counters.

The field names are public API: the daemon, the CLI and the metrics use them as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class Counters:
    """Monotonic counters, mutated by the cache as events happen (tokens unless named bytes)."""

    hit_device_tokens: int = 0  # matched tokens already on the device
    hit_host_tokens: int = 0  # matched tokens found on the host only
    miss_tokens: int = 0  # requested tokens not cached at all
    backup_tokens: int = 0  # acknowledged device->host copies
    backup_bytes: int = 0
    backup_failed_tokens: int = 0  # backups refused (host full) or failed
    load_tokens: int = 0  # acknowledged host->device copies
    load_bytes: int = 0
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    transfer_errors: int = 0  # copies whose ack reported an error
    corrupt_host_tokens: int = 0  # host tokens dropped: their pages changed since written
    match_calls: int = 0
    insert_calls: int = 0
    load_back_calls: int = 0


@dataclass(frozen=True)
class CacheStats:
    """Sizes (tokens) at one moment, plus the counters."""

    page_size: int
    device_capacity_tokens: int  # allocatable device slots (the padding page excluded)
    device_free_tokens: int
    device_cached_tokens: int  # device tokens held by the tree
    device_owned_tokens: int  # allocated by callers, not inserted yet
    device_protected_tokens: int  # tree device tokens under a lock
    device_evictable_tokens: int  # tree device tokens with no lock
    host_capacity_tokens: int
    host_free_tokens: int
    host_cached_tokens: int
    inflight_transfers: int  # copies submitted and not yet acknowledged
    tree_nodes: int
    hit_device_tokens: int
    hit_host_tokens: int
    miss_tokens: int
    backup_tokens: int
    backup_bytes: int
    backup_failed_tokens: int
    load_tokens: int
    load_bytes: int
    evicted_device_tokens: int
    evicted_host_tokens: int
    transfer_errors: int
    corrupt_host_tokens: int
    match_calls: int
    insert_calls: int
    load_back_calls: int

    @property
    def requested_tokens(self) -> int:
        return self.hit_device_tokens + self.hit_host_tokens + self.miss_tokens

    def hit_ratio(self, tier: str = "all") -> float:
        """Share of requested tokens hit on ``device``, ``host`` or either (``all``)."""
        hits = {
            "device": self.hit_device_tokens,
            "host": self.hit_host_tokens,
            "all": self.hit_device_tokens + self.hit_host_tokens,
        }[tier]
        return hits / self.requested_tokens if self.requested_tokens else 0.0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def zero(cls, page_size: int = 0) -> CacheStats:
        """The figures of a cache that does not exist yet (a daemon for engines before the
        first layout): every size and count 0."""
        values = {f.name: 0 for f in dataclasses.fields(cls)}
        return cls(**{**values, "page_size": page_size})
