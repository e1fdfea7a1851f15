"""MovedLocks: where a caller's lock went when its node lost its device copy under it.

A lock (``inc_lock_ref``) normally stays on its node until ``dec_lock_ref``. One event can take
a locked node's device copy away: a load-back whose copy failed (its device pages hold
garbage, and garbage must never be readable, locked or not). The cache then moves every lock
on such a node to the nearest device ancestor that stays (the load's anchor, maybe a root), and
records the move here, so that the caller's later ``dec_lock_ref(node)`` (or a second
``inc_lock_ref(node)``) acts on where the lock went. Counts only: locks are anonymous.

Mutated by HiRadixCache on its one thread; integrity.py checks it against the tree.
"""

from __future__ import annotations

from collections import Counter

from hicache.tree.node import TreeNode


class MovedLocks:
    def __init__(self) -> None:
        # node that lost its device copy -> {node now holding those locks: how many}
        self._moves: dict[TreeNode, Counter[TreeNode]] = {}

    def __len__(self) -> int:
        return sum(sum(c.values()) for c in self._moves.values())

    def add(self, node: TreeNode, target: TreeNode, count: int = 1) -> None:
        """Record ``count`` locks of ``node`` now held on ``target``."""
        self._moves.setdefault(node, Counter())[target] += count

    def count(self, node: TreeNode) -> int:
        """Locks taken on ``node`` that now live elsewhere."""
        moved = self._moves.get(node)
        return sum(moved.values()) if moved else 0

    def target(self, node: TreeNode) -> TreeNode | None:
        """Where one of ``node``'s moved locks lives (None when none moved)."""
        moved = self._moves.get(node)
        return next(iter(moved)) if moved else None

    def take(self, node: TreeNode) -> TreeNode | None:
        """Forget one moved lock of ``node``; returns where it lived (None when none moved)."""
        moved = self._moves.get(node)
        if not moved:
            return None
        target = next(iter(moved))
        moved[target] -= 1
        if not moved[target]:
            del moved[target]
        if not moved:
            del self._moves[node]
        return target

    def by_target(self) -> Counter[TreeNode]:
        """Moved locks per node holding them (for the integrity check)."""
        total: Counter[TreeNode] = Counter()
        for moved in self._moves.values():
            total.update(moved)
        return total
