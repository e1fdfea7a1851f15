"""The third tier: KV pages in an existing distributed store, shared by daemons on many machines.

- ``keys.py``: what a page is called everywhere (a chained hash seeded with what makes KV differ);
- ``pages.py``: where a host page's bytes are, and the checksum every value carries;
- ``store.py``: the interface every store implements, with ``memory.py`` (in-process, with
  fault injection, for tests), ``redis_store.py`` (Redis Cluster) and ``mooncake.py``
  (Mooncake Store) behind it, chosen by ``open_store(url)`` (``registry.py``);
- ``breaker.py``: stop asking a store that fails, probe it again later.

Heavy clients (redis, mooncake) are imported only by the store that needs them.
"""

from __future__ import annotations

from hicache.l3.registry import open_store
from hicache.l3.store import L3Store, StoreDown

__all__ = ["L3Store", "StoreDown", "open_store"]
