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
from hicache.tokens import pages_of_aligned

_NO_PAGES = np.empty(0, dtype=np.int64)


class InsertMixin:
    def _insert(self, tokens: np.ndarray, slots: np.ndarray, namespace: Namespace) -> int:
        ps, alloc = self.page_size, self.device_alloc
        aligned = len(tokens) // ps * ps
        alloc.check_slot_range(slots)
        slots = slots.copy()  # the tree keeps slices: never alias the caller's memory
        root = self.tree.root(namespace, create=True)
        key = tokens.tobytes() if aligned == len(tokens) else tokens[:aligned].tobytes()
        path, covered = self.tree.walk(root, key)
        dup, adopt = self._classify(path, slots)
        new = slots[covered >> 2 : aligned]
        try:
            theirs = [*dup, *(m for _, m in adopt), new]
            theirs = pages_of_aligned(np.concatenate(theirs) if len(theirs) > 1 else new, ps)
            tail = self._tail_page(slots[aligned:])
            alloc.check_owned(np.concatenate([theirs, tail]) if len(tail) else theirs)
        except Exception:
            self._drop_empty_root(root)
            raise
        for node, mine in adopt:
            alloc.state[node_pages(mine, ps)] = PageState.TREE
            self.tree.set_device(node, mine)
        touched: list[TreeNode] = list(path)
        if len(new):
            alloc.state[node_pages(new, ps)] = PageState.TREE
            touched.append(self.tree.add_leaf(path[-1] if path else root, key[covered:], new))
        if dup or len(tail):
            alloc.release(np.concatenate([*(node_pages(d, ps) for d in dup), tail]))
        if touched:
            self._push_device(touched[-1])
            self._backup_hot(touched)
        else:
            self._drop_empty_root(root)
        return covered >> 2

    @staticmethod
    def _classify(path: list[TreeNode], slots: np.ndarray) -> tuple[list, list]:
        """Split the covered part of ``slots`` into duplicates of device nodes (to free) and
        pages for host-only nodes (to adopt); slots equal to the tree's own are neither."""
        if not path:
            return [], []
        if all(n.device_slots is not None for n in path):  # fast path: one comparison
            own = (
                path[0].device_slots
                if len(path) == 1
                else np.concatenate([n.device_slots for n in path])
            )
            if own.tobytes() == slots[: len(own)].tobytes():
                return [], []
        dup, adopt, pos = [], [], 0
        for node in path:
            mine = slots[pos : pos + node.num_tokens]
            pos += node.num_tokens
            if node.device_slots is None:
                adopt.append((node, mine))
            elif node.device_slots.tobytes() != mine.tobytes():
                dup.append(mine)
        return dup, adopt

    def _tail_page(self, tail: np.ndarray) -> np.ndarray:
        """The page of an unaligned tail (fewer than page_size slots): it must be the first
        slots of one page, in order, as alloc and alloc_extend hand them out."""
        if not len(tail):
            return _NO_PAGES
        ps = self.page_size
        first = int(tail[0])
        if first % ps or tail.tolist() != list(range(first, first + len(tail))):
            raise InvalidIndicesError("device_indices: the unaligned tail must start a page")
        return np.array([first // ps], dtype=np.int64)

    def _drop_empty_root(self, root: TreeNode) -> None:
        if not root.children and root.namespace is not None:
            self.tree._roots.pop(root.namespace, None)
