"""The daemon's integrity check: the cache's invariants, plus the sessions' against it."""

from __future__ import annotations

import numpy as np

from hicache.cache import HiRadixCache
from hicache.daemon.sessions import SessionTable
from hicache.errors import IntegrityError
from hicache.memory import OWNED
from hicache.tree import TreeNode


def check_sessions(cache: HiRadixCache | None, sessions: SessionTable) -> None:
    """The cache's invariants and the sessions': every OWNED page is owned by exactly one
    session (live or in quarantine) or to a fetch from the store below, and every session
    lock is a lock the cache holds on an in-tree node. Raises IntegrityError; changes
    nothing."""
    sessions.check_integrity()
    if cache is None:
        if any(s.owned or s.locks for s in sessions.holders()):
            raise IntegrityError("a session holds pages or locks, and there is no pool")
        return
    cache.check_integrity()
    seen: dict[int, int] = {}
    locks: dict[TreeNode, int] = {}
    for s in sessions.holders():
        for page in s.owned:
            if page in seen:
                raise IntegrityError(f"page {page} owned by sessions {seen[page]} and {s.id}")
            seen[page] = s.id
            if cache.page_states(np.array([page])) != OWNED:
                raise IntegrityError(f"session {s.id} owns page {page}, which is not OWNED")
        for record in s.locks.values():
            locks[record.node] = locks.get(record.node, 0) + 1
        charged = [record.pinned for record in s.locks.values()]
        if min(charged, default=0) < 0 or s.pinned_pages != sum(charged):
            raise IntegrityError(
                f"session {s.id}: {s.pinned_pages} pinned pages, its locks say {charged[:8]}"
            )
    owned = cache.count_pages(OWNED)
    if cache.l3 is not None:  # (pages a fetch from the store below holds: its own, checked)
        owned -= cache.l3.owned_by_fetches("device")
    if owned != len(seen):
        raise IntegrityError(f"{owned} OWNED pages, {len(seen)} owned by sessions")
    for node, count in locks.items():  # (a lock on a root, a miss, holds nothing)
        if not node.is_root and cache.lock_count(node) < count:
            raise IntegrityError(f"{node}: sessions hold {count} locks the cache does not")
