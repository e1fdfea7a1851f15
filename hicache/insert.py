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
from hicache.node import TreeNode
from hicache.radix_tree import Namespace
from hicache.tokens import pages_of_aligned

_NO_PAGES = np.empty(0, dtype=np.int64)


class InsertMixin:
    def _insert(self, tokens: np.ndarray, slots: np.ndarray, namespace: Namespace) -> int:
        ps, alloc = self.page_size, self.device_alloc
        aligned = len(tokens) // ps * ps
        tail_pages = alloc.pages_of_slots(slots[aligned:]) if aligned < len(slots) else _NO_PAGES
        alloc.check_slot_range(slots)
        pages = pages_of_aligned(slots[:aligned], ps)
        alloc.check_pages(pages)  # distinct, allocated, not the padding page
        root = self.tree.root(namespace, create=True)
        key = tokens[:aligned].tobytes()
        path, covered = self.tree.walk(root, key)
        to_free, adopt, pos = [tail_pages], [], 0
        for node in path:
            mine = pages[pos : pos + node.num_tokens // ps]
            pos += len(mine)
            if node.device_pages is None:
                adopt.append((node, mine))
            elif not np.array_equal(node.device_pages, mine):
                to_free.append(mine)
        new = pages[pos:]
        try:
            alloc.check_pages(
                np.concatenate([*to_free, *(p for _, p in adopt), new]), PageState.OWNED
            )
        except Exception:
            self._drop_empty_root(root)
            raise
        for node, mine in adopt:
            alloc.state[mine] = PageState.TREE
            self.tree.set_device(node, mine)
        touched: list[TreeNode] = list(path)
        if len(new):
            alloc.state[new] = PageState.TREE
            touched.append(self.tree.add_leaf(path[-1] if path else root, key[covered:], new))
        alloc.release(np.concatenate(to_free))
        if touched:
            self._push_device(touched[-1])
            self._backup_hot(touched)
        else:
            self._drop_empty_root(root)
        return covered // 4

    def _drop_empty_root(self, root: TreeNode) -> None:
        if not root.children and root.namespace is not None:
            self.tree._roots.pop(root.namespace, None)
