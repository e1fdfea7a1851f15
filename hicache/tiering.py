"""Tiering: eviction on both tiers, and allocation that makes room (composed by HiRadixCache).

Device eviction takes unlocked device leaves (nodes with no device child and no transfer in
flight), lowest priority first:

- with a host copy: the device pages are freed now; the node stays as host-only;
- without one, when the write policy backs up on eviction (or the node has host-only
  children to keep reachable): a backup starts and the pages are freed at its ack;
- otherwise the node leaves the tree and its pages are freed.

Host eviction removes host-only leaves (no children at all; host-only nodes never take part in
a transfer). Both re-queue a parent that becomes a candidate.

What it touches is what its constructor takes: the tree, both page allocators and both
eviction heaps, the write policy and the counters, and a maker of the transfer book: each calls
the other, so the constructor hands itself to ``make_book`` (the book's ``Room``). It asks the
book to back up what eviction must keep and to settle the
copies in flight when it needs their pages, and the third tier (``l3``, once attached)
whether it takes pages that leave. Control thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from hicache.memory import PagedAllocator, PageState
from hicache.observe import Counters
from hicache.tree import IO_NONE, LeafHeap, RadixTree, TreeNode
from hicache.types import EvictResult
from hicache.write_policy import WritePolicy

if TYPE_CHECKING:
    from hicache.cache_view import Backups
    from hicache.l3 import L3Tier

# Rebuild a heap when it holds this many times more entries than the tree has nodes.
HEAP_GARBAGE_FACTOR = 4


class Tiering:
    def __init__(
        self,
        tree: RadixTree,
        device_alloc: PagedAllocator,
        host_alloc: PagedAllocator | None,
        device_heap: LeafHeap,
        host_heap: LeafHeap,
        write_policy: WritePolicy,
        counters: Counters,
        make_book: Callable[[Tiering], Backups],
    ):
        self.tree = tree
        self.page_size = tree.page_size
        self.device_alloc = device_alloc
        self.host_alloc = host_alloc  # None: no host tier
        self.device_heap = device_heap  # device eviction candidates
        self.host_heap = host_heap  # host eviction candidates
        self.write_policy = write_policy  # whether eviction backs up first
        self.counters = counters  # evicted tokens
        self.l3: L3Tier | None = None  # the store under the lowest pool (attach_l3)
        self.book: Backups = make_book(self)  # backups and the copies in flight

    # ---- candidates ----------------------------------------------------------------------
    @staticmethod
    def device_candidate(node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.device_pages is not None
            and node.lock_ref == 0
            and node.io is IO_NONE
            and not node.has_device_child()
        )

    @staticmethod
    def host_candidate(node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.device_pages is None
            and node.host_pages is not None
            and not node.children
            and node.host_ref == 0
        )

    def push_device(self, node: TreeNode | None) -> None:
        if node is not None and self.device_candidate(node):
            if self.device_heap.push(node) > HEAP_GARBAGE_FACTOR * self.tree.num_nodes + 64:
                nodes = self.tree.iter_nodes()
                self.device_heap.rebuild(n for n in nodes if self.device_candidate(n))

    def push_host(self, node: TreeNode | None) -> None:
        if node is not None and self.host_alloc is not None and self.host_candidate(node):
            if self.host_heap.push(node) > HEAP_GARBAGE_FACTOR * self.tree.num_nodes + 64:
                nodes = self.tree.iter_nodes()
                self.host_heap.rebuild(n for n in nodes if self.host_candidate(n))

    # ---- device ---------------------------------------------------------------------------
    def evict(self, num_tokens: int, to_l3: bool = True) -> EvictResult:
        """Evict at least ``num_tokens`` device tokens if candidates allow (whole nodes, so it
        may free more). ``pending`` tokens are freed when their backup is acknowledged.
        ``to_l3=False`` (a flush): no write-back to a third tier under the only pool."""
        freed = pending = 0
        backups: dict[TreeNode, None] = {}  # ordered set: stays a candidate until issued
        while freed + pending < num_tokens:
            node = self.device_heap.pop(self.device_candidate)
            if node is None:
                break
            if node in backups:
                continue
            if node.host_pages is not None:
                freed += self.drop_device(node)
            elif self.host_alloc is not None and (
                self.write_policy.backup_on_evict or node.children
            ):
                backups[node] = None
                pending += node.num_tokens
            elif self.delete_device_leaf(node, to_l3):
                freed += node.num_tokens
            else:  # a write to the third tier still reads its pages: freed when it ends
                pending += node.num_tokens
        if backups:
            if not self.book.backup(list(backups), evict_on_ack=True):
                pending = 0
                for node in backups:  # the host is full: fall back to dropping them
                    self.drop_host_subtrees(node)
                    self.delete_device_leaf(node, to_l3)  # (free now: there is a host tier)
                    freed += node.num_tokens
        self.counters.evicted_device_tokens += freed
        return EvictResult(freed, pending)

    def drop_device(self, node: TreeNode) -> int:
        """Free a synced node's device pages; it stays in the tree as host-only."""
        self.device_alloc.release(node.device_page_ids())
        self.tree.set_device(node, None)
        self.push_host(node)
        self.push_device(node.parent)
        return node.num_tokens

    def delete_device_leaf(self, node: TreeNode, to_l3: bool = True) -> bool:
        """Remove a device-only childless node from the tree; returns whether its pages are
        free now. Without a host tier, a write to a third tier under the device pool that
        still reads them takes them instead, and frees them when it ends (False)."""
        parent = node.parent
        l3 = self.l3
        free = l3 is None or self.host_alloc is not None or not l3.evicting(node, to_l3)
        if free:
            self.device_alloc.release(node.device_page_ids())
        self.tree.set_device(node, None)
        self.tree.remove_leaf(node)
        self.push_device(parent)
        self.push_host(parent)
        return free

    def drop_host_subtrees(self, node: TreeNode) -> None:
        """Remove every (host-only) descendant of ``node``, freeing their host pages."""
        stack = list(node.children.values())
        order: list[TreeNode] = []
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(child.children.values())
        for child in reversed(order):  # children before parents
            self.release_host(child)
            child.host_pages = None
            self.tree.remove_leaf(child)
            self.counters.evicted_host_tokens += child.num_tokens

    def alloc_device(self, num_pages: int, state: PageState) -> np.ndarray | None:
        """Allocate device pages, evicting (and waiting for write-back acks) when short."""
        pages = self.device_alloc.alloc_pages(num_pages, state)
        if pages is None:
            self.make_device_room(num_pages)
            pages = self.device_alloc.alloc_pages(num_pages, state)
        return pages

    def make_device_room(self, num_pages: int) -> None:
        """Evict until ``num_pages`` are free, or nothing more can be evicted. A request larger
        than the whole pool evicts nothing: it could never succeed."""
        alloc = self.device_alloc
        if num_pages > alloc.capacity_pages:
            return
        while alloc.free_pages < num_pages:
            result = self.evict((num_pages - alloc.free_pages) * self.page_size)
            if alloc.free_pages >= num_pages:
                return
            if self.book.settle():  # acks free write-back pages and release backup locks
                continue
            if self.l3 is not None and self.l3.collect_writes():  # (never waits for one)
                continue
            if result.freed == 0:
                return

    # ---- host -----------------------------------------------------------------------------
    def evict_host(self, num_tokens: int, to_l3: bool = True) -> int:
        """Remove host-only leaves until ``num_tokens`` host tokens are freed (or none is left).
        Returns the tokens freed (given back at once, or when a write to the third tier that
        reads them ends). ``to_l3=False`` (a flush): no write-back to the third tier."""
        if self.host_alloc is None:
            return 0
        freed = 0
        while freed < num_tokens:
            node = self.host_heap.pop(self.host_candidate)
            if node is None:
                break
            parent = node.parent
            self.release_host(node, to_l3)
            node.host_pages = None
            self.tree.remove_leaf(node)
            freed += node.num_tokens
            self.push_host(parent)
            self.push_device(parent)
        self.counters.evicted_host_tokens += freed
        return freed

    def release_host(self, node: TreeNode, to_l3: bool = True) -> None:
        """Give back a node's host pages, unless the third tier takes them (a write-back, or a
        write still reading them): then they are freed when that write ends."""
        l3 = self.l3
        if l3 is not None and l3.evicting(node, to_l3):
            return
        assert self.host_alloc is not None and node.host_pages is not None  # (a host node)
        self.host_alloc.release(node.host_pages)

    def alloc_host_pages(self, num_pages: int, state: PageState) -> np.ndarray | None:
        """Allocate host pages (marked ``state``), evicting host-only leaves when short."""
        assert self.host_alloc is not None  # (callers: the host side, with a host tier)
        pages = self.host_alloc.alloc_pages(num_pages, state)
        if pages is None:
            self.evict_host((num_pages - self.host_alloc.free_pages) * self.page_size)
            pages = self.host_alloc.alloc_pages(num_pages, state)
        return pages
