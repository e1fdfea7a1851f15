"""What HiRadixCache's collaborators outside its class may see of it, as interfaces.

The invariant checks (``integrity.py``) and the third tier (``l3/tier.py``, ``l3/sides.py``)
are given the cache itself, but they are typed against these Protocols, not the class, so
that they do not import ``cache.py`` (which composes them) and a reader sees, here, all they
may touch. Nothing here is run; HiRadixCache satisfies both.

- ``CacheView``: read only (the checks change nothing);
- ``L3Host``: what the third tier reads, and the parts it calls to allocate pages, put fetched
  pages into the tree and evict for room (``tree``, ``tiering``; each on the cache's one thread);
- ``Backups`` and ``Room``: what the cache's two parts that call each other see of each other
  (``Tiering`` backs up through the ``TransferBook``, the book gets pages and drops nodes
  through tiering), so that neither module imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections import Counter

    import numpy as np

    from hicache.config import HiCacheConfig
    from hicache.memory import PagedAllocator, PageState
    from hicache.tree import RadixTree, TreeNode
    from hicache.types import EvictResult


class CacheView(Protocol):
    """The cache's state as ``check_cache_integrity`` reads it."""

    page_size: int
    tree: RadixTree
    device_alloc: PagedAllocator
    host_alloc: PagedAllocator | None
    device_heap: Any  # LeafHeap: device eviction candidates
    host_heap: Any  # LeafHeap: host eviction candidates
    engine: Any  # TransferEngine | None: copies in flight, page sums
    user_locks: Counter[TreeNode]  # locks callers took, per node
    moved_locks: Any  # MovedLocks: user locks moved off nodes a failed load dropped
    events: Any  # TierEvents | None: what KV events announced
    l3: Any  # L3Tier | None: the third tier (its own checks, the pages it holds)

    @property
    def tiering(self) -> Room:  # who is an eviction candidate
        ...

    @property
    def records(self) -> dict[Any, Any]:  # (TransferRecord: transfers/ sits above this)
        """By ticket: copies submitted, not acknowledged."""
        ...


class L3Host(Protocol):
    """The cache as the third tier uses it."""

    config: HiCacheConfig
    page_size: int
    tree: RadixTree
    engine: Any  # TransferEngine | None (page sums)
    device_alloc: PagedAllocator
    host_alloc: PagedAllocator | None
    device_pool: Any  # DevicePool
    host_pool: Any  # HostPool | None

    @property
    def tiering(self) -> Room:  # room for fetched pages (allocation that evicts), candidates
        ...

    def evict(self, num_tokens: int, to_l3: bool = True) -> EvictResult:
        """Mutates: frees device pages (for room to fetch into)."""
        ...


class Backups(Protocol):
    """The transfer book as tiering uses it (``transfers/book.py``)."""

    def backup(self, nodes: list[TreeNode], evict_on_ack: bool) -> bool:
        """Mutates: starts one copy of ``nodes`` to fresh host pages; False (nothing changed)
        when the host pool is full even after host eviction."""
        ...

    def settle(self) -> bool:
        """Mutates: waits for every copy in flight and processes the acks; False when none."""
        ...


class Room(Protocol):
    """Tiering as the transfer book uses it (``tiering.py``)."""

    def alloc_device(self, num_pages: int, state: PageState) -> np.ndarray | None:
        """Mutates the device allocator (evicting if needed); None when no room."""
        ...

    def alloc_host_pages(self, num_pages: int, state: PageState) -> np.ndarray | None:
        """Mutates the host allocator (evicting host leaves if needed); None when no room."""
        ...

    def push_device(self, node: TreeNode | None) -> None:
        """Mutates the device eviction heap: ``node`` may now be a candidate."""
        ...

    def push_host(self, node: TreeNode | None) -> None:
        """Mutates the host eviction heap: ``node`` may now be a candidate."""
        ...

    def device_candidate(self, node: TreeNode) -> bool: ...

    def host_candidate(self, node: TreeNode) -> bool: ...

    def drop_device(self, node: TreeNode) -> int:
        """Mutates: frees a synced node's device pages (it stays host-only); its tokens."""
        ...

    def drop_host_subtrees(self, node: TreeNode) -> None:
        """Mutates: removes every host-only descendant of ``node``, freeing their pages."""
        ...

    def release_host(self, node: TreeNode, to_l3: bool = True) -> None:
        """Mutates: gives back a node's host pages (unless the third tier takes them)."""
        ...
