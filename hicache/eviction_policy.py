"""Eviction order and the lazy heap of candidate leaves.

Why a lazy heap: SGLang collects and heapifies every leaf on each evict() call, which is linear
in the tree size. Here a node is pushed whenever it may have become a candidate or its priority
changed; stale entries (node changed, left the tree, or is no longer a candidate) are skipped
when popped. Each entry carries the priority it was pushed with, so a node that was touched
again is evicted by its newest priority only. The heap is rebuilt when garbage dominates.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from hicache.config import EvictionPolicyName, HiCacheConfig
from hicache.node import TreeNode

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

    The owner calls ``push(node)`` after any change that can make ``node`` a candidate or move
    its priority, and passes its candidate test to ``pop``.
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
            if is_candidate(node) and prio == priority(node):
                return node
        return None

    def rebuild(self, candidates: Iterable[TreeNode]) -> None:
        """Drop all garbage: the heap becomes exactly ``candidates``."""
        self._heap = [(self._priority(n), n.id, n) for n in candidates]
        heapq.heapify(self._heap)
