"""Insert: hand a finished prefix to the tree (a mixin of HiRadixCache).

Index regions of one insert call (page_size 4, 14 tokens; ``|`` marks page boundaries)::

    tokens   | t0..t3 | t4..t7 | t8..t11 | t12 t13 |
    tree     | node A (device) | node B  |            walk() covers A and B (8 + 4 tokens)
    slots    | A's own pages   | dup     | tail page  |
               left alone        freed     freed (unaligned tail; the tree holds whole pages)

If B were host-only, the caller's pages for it would be adopted as its device copy instead
of freed; tokens past the covered part become one new leaf with the caller's pages.
"""

from __future__ import annotations

import numpy as np

from hicache.allocator import PageState
from hicache.errors import InvalidIndicesError
from hicache.node import TreeNode, node_pages
from hicache.radix_tree import Namespace

_NO_PAGES = np.empty(0, dtype=np.int64)


class InsertMixin:
    def _insert(self, tokens: np.ndarray, slots: np.ndarray, namespace: Namespace) -> int:
        ps, alloc = self.page_size, self.device_alloc
        aligned = len(tokens) // ps * ps
        raw = slots.astype("<i8", copy=False).tobytes()  # 8 bytes per slot, like node values
        root = self.tree.root(namespace, create=True)
        key = tokens.tobytes() if aligned == len(tokens) else tokens[:aligned].tobytes()
        path, covered = self.tree.walk(root, key)
        dup, adopt = self._classify(path, raw)
        new = raw[2 * covered : 8 * aligned]
        try:
            # Only slots that are not the tree's own (at their own place) need checking: they
            # must be the caller's whole pages, distinct. Tree pages are TREE, so they fail.
            theirs = b"".join([*dup, *(m for _, m in adopt), new]) if dup or adopt else new
            pages = alloc.whole_pages(np.frombuffer(theirs, np.int64))
            tail = self._tail_page(slots[aligned:])
            alloc.check_owned(np.concatenate([pages, tail]) if len(tail) else pages)
        except Exception:
            self._drop_empty_root(root)
            raise
        for node, mine in adopt:
            alloc.state[self._pages_of(mine)] = PageState.TREE
            self.tree.set_device(node, mine)
        touched: list[TreeNode] = list(path)
        if new:
            alloc.state[self._pages_of(new)] = PageState.TREE
            touched.append(self.tree.add_leaf(path[-1] if path else root, key[covered:], new))
        if dup or len(tail):
            alloc.release(np.concatenate([*(self._pages_of(d) for d in dup), tail]))
        if touched:
            self._push_device(touched[-1])
            self._backup_hot(touched)
        else:
            self._drop_empty_root(root)
        return covered >> 2

    def _pages_of(self, raw: bytes) -> np.ndarray:
        return node_pages(np.frombuffer(raw, dtype=np.int64), self.page_size)

    @staticmethod
    def _classify(path: list[TreeNode], raw: bytes) -> tuple[list[bytes], list]:
        """Split the covered part of ``raw`` (slot bytes) into duplicates of device nodes (to
        free) and slots for host-only nodes (to adopt); the tree's own slots are neither."""
        if not path:
            return [], []
        if all(n.device_slots is not None for n in path):  # fast path: one comparison
            own = b"".join([n.device_slots for n in path])
            if own == raw[: len(own)]:
                return [], []
        dup, adopt, pos = [], [], 0
        for node in path:
            mine = raw[pos : pos + 8 * node.num_tokens]
            pos += len(mine)
            if node.device_slots is None:
                adopt.append((node, mine))
            elif node.device_slots != mine:
                dup.append(mine)
        return dup, adopt

    def _tail_page(self, tail: np.ndarray) -> np.ndarray:
        """The page of an unaligned tail (fewer than page_size slots): it must be the first
        slots of one page, in order, as alloc and alloc_extend hand them out."""
        if not len(tail):
            return _NO_PAGES
        ps, first = self.page_size, int(tail[0])
        in_pool = 0 <= first and first + len(tail) <= self.device_alloc.num_pages * ps
        if not in_pool or first % ps or tail.tolist() != list(range(first, first + len(tail))):
            raise InvalidIndicesError("device_indices: the unaligned tail must start a page")
        return np.array([first // ps], dtype=np.int64)

    def _drop_empty_root(self, root: TreeNode) -> None:
        if not root.children and root.namespace is not None:
            self.tree._roots.pop(root.namespace, None)
