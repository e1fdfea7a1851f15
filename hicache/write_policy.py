"""Write policies: when device KV gets a host copy. Chosen once from the config.

Two mechanisms, and each policy is a choice between them:

- *Backup on hit*: when a device node's hit count reaches ``backup_threshold`` the cache copies
  it to the host. The node is **locked** until the copy is acknowledged, so its device pages can
  be neither evicted nor reused while the copy reads them.
- *Backup on evict*: device eviction of a node without a host copy copies it first. The node
  becomes host-only at once and is **not locked**; its device pages move to the INFLIGHT state
  and return to the free list only when the copy is acknowledged.

Whatever the policy, a node that has host-only children is backed up at eviction rather than
deleted, so the host data below it stays reachable.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.config import HiCacheConfig, WritePolicyName


@dataclass(frozen=True)
class WritePolicy:
    name: WritePolicyName
    backup_threshold: int | None  # hits that trigger a backup; None: never on hits
    backup_on_evict: bool  # copy to host at device eviction instead of dropping

    def wants_backup(self, hit_count: int) -> bool:
        """Whether a device node with this many hits and no host copy should be backed up."""
        return self.backup_threshold is not None and hit_count >= self.backup_threshold


def make_write_policy(config: HiCacheConfig) -> WritePolicy:
    name = WritePolicyName(config.write_policy)
    if name is WritePolicyName.WRITE_THROUGH:
        return WritePolicy(name, backup_threshold=1, backup_on_evict=False)
    if name is WritePolicyName.WRITE_THROUGH_SELECTIVE:
        return WritePolicy(name, config.write_through_threshold, backup_on_evict=False)
    return WritePolicy(name, backup_threshold=None, backup_on_evict=True)
