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

from hicache.allocator import OWNED, TREE
from hicache.fastpath import claim_pages
from hicache.node import TreeNode
from hicache.radix_tree import Namespace


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
            # must be the caller's whole pages (plus one partial tail page), distinct. Tree
            # pages are TREE, not OWNED, so passing them anywhere else fails here. All of them
            # become TREE now; the duplicates and the tail page are released just below.
            theirs = raw[2 * covered :]  # the new whole pages, then the partial tail page
            if dup or adopt:
                theirs = b"".join([*dup, *(m for _, m in adopt), theirs])
            pages = claim_pages(alloc, theirs, OWNED, TREE)
        except Exception:
            self._drop_empty_root(root)
            raise
        for node, mine in adopt:
            self.tree.set_device(node, mine)
        leaf = self.tree.add_leaf(path[-1] if path else root, key[covered:], new) if new else None
        if dup or aligned < len(tokens):  # duplicates and the partial tail page go back
            tail = pages[len(pages) - 1 :] if aligned < len(tokens) else pages[:0]
            n_dup = sum(len(d) for d in dup) // (8 * ps)
            alloc.release(np.concatenate([pages[:n_dup], tail]) if dup else tail)
        last = leaf or (path[-1] if path else None)
        if last is None:
            self._drop_empty_root(root)
            return 0
        self._push_device(last)
        if self.host_alloc is not None:
            self._backup_hot(path + [leaf] if leaf else path)
        return covered >> 2

    def _classify(self, path: list[TreeNode], raw: bytes) -> tuple[list[bytes], list]:
        """Split the covered part of ``raw`` (slot bytes) into duplicates of device nodes (to
        free) and slots for host-only nodes (to adopt); the tree's own slots are neither.

        A caller may pass the tree's own slots for part of a node and its own for the rest (an
        engine that recomputed the last page of a full hit): the check is then page by page.
        """
        if not path:
            return [], []
        dup, adopt, pos = [], [], 0
        for node in path:
            own = node.device_slots
            if own is not None and raw.startswith(own, pos):  # the tree's own slots: no copy
                pos += len(own)
                continue
            mine = raw[pos : pos + 8 * node.num_tokens]
            pos += len(mine)
            if own is None:
                adopt.append((node, mine))
                continue
            ps = self.page_size
            theirs = np.frombuffer(mine, dtype=np.int64).reshape(-1, ps)
            differ = (theirs != np.frombuffer(own, dtype=np.int64).reshape(-1, ps)).any(axis=1)
            dup.append(theirs[differ].tobytes())
        return dup, adopt

    def _drop_empty_root(self, root: TreeNode) -> None:
        if not root.children and root.namespace is not None:
            self.tree._roots.pop(root.namespace, None)
