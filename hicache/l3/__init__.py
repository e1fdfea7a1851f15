"""The third tier: KV pages in an existing distributed store, shared by daemons on many machines.

- ``keys.py``: what a page is called everywhere (a chained hash seeded with what makes KV differ);
- ``pages.py``: where a host page's bytes are, and the checksum every value carries;
- ``store.py``: the interface every store implements, with ``memory.py`` (in-process, with
  fault injection, for tests), ``redis_store.py`` (Redis Cluster) and ``mooncake.py``
  (Mooncake Store) behind it, chosen by ``open_store(url)`` (``registry.py``);
- ``breaker.py``: stop asking a store that fails, probe it again later.

- ``config.py``: its settings (``L3Config``) and policies; ``tier.py``: ``L3Tier``, the tier
  composed into the cache (``cache.l3``), with ``sides.py``, ``jobs.py``, ``admission.py``
  (which pages earned a write) and ``worker.py`` (the IO thread) under it.

Heavy clients (redis, mooncake) are imported only by the store that needs them; names are
imported on first use. Nothing outside this package (but its tests) imports its modules: use
the names below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "L3Config": "hicache.l3.config",
    "L3WritePolicy": "hicache.l3.config",
    "PrefetchPolicy": "hicache.l3.config",
    "WRITE_BACK_NEEDS_HOST": "hicache.l3.config",
    "LazyStore": "hicache.l3.registry",
    "check_url": "hicache.l3.registry",
    "open_store": "hicache.l3.registry",
    "L3Store": "hicache.l3.store",
    "StoreDown": "hicache.l3.store",
    "L3Tier": "hicache.l3.tier",
}
__all__ = [
    "L3Config",
    "L3Store",
    "L3Tier",
    "L3WritePolicy",
    "LazyStore",
    "PrefetchPolicy",
    "StoreDown",
    "WRITE_BACK_NEEDS_HOST",
    "check_url",
    "open_store",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.l3.config import WRITE_BACK_NEEDS_HOST, L3Config, L3WritePolicy, PrefetchPolicy
    from hicache.l3.registry import LazyStore, check_url, open_store
    from hicache.l3.store import L3Store, StoreDown
    from hicache.l3.tier import L3Tier
