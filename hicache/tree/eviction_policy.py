"""Eviction order and the lazy heap of candidate leaves.

Why a lazy heap: SGLang collects and heapifies every leaf on each evict() call, which is linear
in the tree size. Here a node is pushed whenever it may have become a candidate; entries of
nodes that are no longer candidates (locked, given a child, left the tree) are skipped when
popped. The heap is rebuilt when garbage dominates.

Why a match pushes nothing: every policy's priority of a node only grows (access times and hit
counts never go back, creation times never change). So an entry keeps a lower bound of its
node's priority, and when the smallest entry is popped with an outdated priority, the node is
pushed again with its current one instead of being evicted. A hit costs no heap operation; only
nodes touched since their push pay, and only when eviction reaches them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from hicache.config import EvictionPolicyName, HiCacheConfig
from hicache.tree.node import TreeNode

Priority = Callable[[TreeNode], Any]

PRIORITIES: dict[EvictionPolicyName, Priority] = {
    # smallest first
    EvictionPolicyName.LRU: lambda n: n.last_access,
    EvictionPolicyName.LFU: lambda n: (n.hit_count, n.last_access),
    EvictionPolicyName.FIFO: lambda n: n.created,
}


def make_priority(config: HiCacheConfig) -> Priority:
    return PRIORITIES[EvictionPolicyName(config.eviction_policy)]


class LeafHeap:
    """Min-heap of eviction candidates for one tier, with lazy deletion.

    The owner calls ``push(node)`` after any change that can make ``node`` a candidate, and
    passes its candidate test to ``pop``. Invariant: every candidate has an entry whose priority
    is at most its current one (priorities only grow).
    """

    def __init__(self, priority: Priority):
        self._priority = priority
        self._heap: list[tuple[Any, int, TreeNode]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> int:
        """Add an entry for ``node``; returns the heap size (live entries and garbage)."""
        heap = self._heap
        heapq.heappush(heap, (self._priority(node), node.id, node))
        return len(heap)

    def pop(self, is_candidate: Callable[[TreeNode], bool]) -> TreeNode | None:
        """The lowest-priority live candidate, removed from the heap; None when none is left."""
        heap, priority = self._heap, self._priority
        while heap:
            prio, _, node = heapq.heappop(heap)
            if not is_candidate(node):
                continue
            now = priority(node)
            if prio == now:
                return node
            heapq.heappush(heap, (now, node.id, node))  # touched since its push: re-key
        return None

    def rebuild(self, candidates: Iterable[TreeNode]) -> None:
        """Drop all garbage: the heap becomes exactly ``candidates``."""
        self._heap = [(self._priority(n), n.id, n) for n in candidates]
        heapq.heapify(self._heap)
