"""The pool the third tier sits under, as the tier sees it: where a node's pages are, how
fetched pages get room, and how they join the tree.

- ``HostSide``: a cache with a host tier (a daemon that owns its device pool). The store sits
  under the host pool: writes read host pages once their backup exists, fetches become
  host-only leaves (a load-back brings them to the device).
- ``OnlySide``: a cache whose one pool is in host memory and has no tier below it (a daemon
  for engines that own their device tier, ``--device-tier engine``: vLLM). The store sits
  under that pool: writes read a node's pages once it is inserted (engines insert only
  complete KV), fetches become ordinary unlocked leaves that engines copy from like any other.

Both run on the cache's control thread; they mutate the tree and the side's allocator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hicache.memory import KVPool, PagedAllocator, PageState
from hicache.tree import IO_BACKUP

if TYPE_CHECKING:
    from hicache.cache_view import L3Host
    from hicache.tree import TreeNode


class HostSide:
    name = "host"
    sessions_own_pages = False  # OWNED pages of this pool are exactly the fetches'

    def __init__(self, cache: L3Host):
        assert cache.host_pool is not None and cache.host_alloc is not None
        self.cache = cache
        self.pool: KVPool = cache.host_pool
        self.alloc: PagedAllocator = cache.host_alloc

    @staticmethod
    def pages(node: TreeNode) -> np.ndarray | None:
        """The node's page ids on this side (None: it has none here)."""
        return node.host_pages

    @staticmethod
    def ready(node: TreeNode) -> bool:
        """Whether the node's pages here hold its KV (a write may read them): not while its
        backup still copies into them."""
        return node.host_pages is not None and node.io is not IO_BACKUP

    def room(self, want: int) -> np.ndarray | None:
        """``want`` OWNED pages, evicting host-only leaves first, then device copies of nodes
        the host holds too (they become host-only, and evictable); None when short."""
        cache = self.cache
        pages = cache.tiering.alloc_host_pages(want, PageState.OWNED)
        if pages is None:
            cache.evict(want * cache.page_size)
            pages = cache.tiering.alloc_host_pages(want, PageState.OWNED)
        return pages

    def add_leaf(self, parent: TreeNode, key: bytes, pages: np.ndarray) -> TreeNode:
        """Fetched, verified OWNED pages become a host-only leaf (TREE)."""
        cache = self.cache
        self.alloc.settle_pages(pages, PageState.TREE)
        if cache.engine is not None and cache.engine.sums is not None:
            cache.engine.sums.seal(pages)  # (verified by the store's own checksum)
        leaf = cache.tree.add_host_leaf(parent, key, pages)
        cache.tiering.push_host(leaf)
        return leaf


class OnlySide:
    name = "only"
    sessions_own_pages = True  # engines' sessions own pages of this pool too

    def __init__(self, cache: L3Host):
        if cache.host_pool is not None or cache.config.device != "cpu":
            raise ValueError("l3: the store sits under the host tier, or under a CPU-only pool")
        self.cache = cache
        self.pool: KVPool = cache.device_pool
        self.alloc: PagedAllocator = cache.device_alloc

    @staticmethod
    def pages(node: TreeNode) -> np.ndarray | None:
        return None if node.device_pages is None else node.device_page_ids()

    @staticmethod
    def ready(node: TreeNode) -> bool:
        """Whether the node's pages hold its KV: from its insert on (engines insert complete
        KV; a fetch inserts verified pages)."""
        return node.device_pages is not None

    def room(self, want: int) -> np.ndarray | None:
        """``want`` OWNED pages, evicting unlocked leaves when short; None when short."""
        return self.cache.tiering.alloc_device(want, PageState.OWNED)

    def add_leaf(self, parent: TreeNode, key: bytes, pages: np.ndarray) -> TreeNode:
        """Fetched, verified OWNED pages become an unlocked leaf (TREE), as an insert makes."""
        cache = self.cache
        self.alloc.settle_pages(pages, PageState.TREE)
        leaf = cache.tree.add_leaf(parent, key, pages.astype("<i8", copy=False).tobytes())
        cache.tiering.push_device(leaf)
        return leaf


def side_of(cache: L3Host) -> HostSide | OnlySide:
    """The side a third tier of ``cache`` sits on: its host tier when it has one."""
    return HostSide(cache) if cache.host_pool is not None else OnlySide(cache)
