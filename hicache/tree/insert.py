"""Insert: hand a finished prefix to the tree (a mixin of HiRadixCache).

Index regions of one insert call (page_size 4, 14 tokens; ``|`` marks page boundaries). Nodes
hold page ids; the caller's slots are validated and turned into page ids once::

    tokens   | t0..t3 | t4..t7 | t8..t11 | t12 t13 |
    tree     | node A (device) | node B  |            walk() covers A and B (8 + 4 tokens)
    slots    | A's own pages   | dup     | tail page  |
               left alone        freed     freed (unaligned tail; the tree holds whole pages)

If B were host-only, the caller's pages for it would be adopted as its device copy instead
of freed; tokens past the covered part become one new leaf with the caller's pages.
"""

from __future__ import annotations

import numpy as np

from hicache.memory import OWNED, TREE
from hicache.tree.fastpath import own_nodes, slot_pages
from hicache.tree.node import IO_LOAD, TreeNode
from hicache.tree.radix_tree import Namespace


class InsertMixin:
    def _insert(self, tokens: np.ndarray, slots: np.ndarray, namespace: Namespace) -> int:
        ps, alloc = self.page_size, self.device_alloc
        aligned = len(tokens) // ps * ps
        raw = slots.astype("<i8", copy=False).tobytes()  # 8 bytes per slot
        root = self.tree.root(namespace, create=True)
        key = tokens.tobytes()  # the walk never covers the partial tail page (radix_tree.walk)
        path, covered = self.tree.walk(root, key)
        if path and any(node.io is IO_LOAD for node in path):
            # a load still writes part of this prefix and may yet fail: let it land, so that
            # nothing new hangs below KV that could turn out to be garbage
            self.wait_load(path[-1])
            path, covered = self.tree.walk(root, key)
        n_covered = covered >> 2  # tokens the tree holds already (whole pages)
        dup, adopt = self._classify(path, raw)
        # the duplicates, the adopted pages, the new whole pages, then the partial tail page
        theirs = raw[8 * n_covered :]
        if dup or adopt:
            theirs = b"".join([*dup, *(m for _, m in adopt), theirs])
        tail = aligned < len(tokens)  # a partial tail page: freed by the claim itself
        # page ids as int64 bytes: a page's 8 * ps slot bytes become 8 (``at`` counts bytes)
        pages = self._claim(root, theirs, tail)
        at = dup_bytes = sum(map(len, dup)) // ps if dup else 0
        for node, mine in adopt:
            n = len(mine) // ps
            self.tree.set_device(node, pages[at : at + n])
            at += n
        leaf = None
        if aligned > n_covered:  # the rest becomes one new leaf (often all of ``pages``)
            new = pages[at : at + 8 * (aligned - n_covered) // ps]
            leaf = self.tree.add_leaf(path[-1] if path else root, key[covered : 4 * aligned], new)
        if dup:  # duplicates go back
            alloc.release(np.frombuffer(pages, dtype=np.int64, count=dup_bytes // 8))
        last = leaf or (path[-1] if path else None)
        if last is None:
            self._drop_empty_root(root)
            return 0
        self._push_device(last)
        if self.host_alloc is not None:
            self._backup_hot(path + [leaf] if leaf else path)
        elif self.l3 is not None and leaf is not None:  # the store sits under this pool
            self.l3.after_backup([leaf])
        return n_covered

    def _claim(self, root: TreeNode, theirs: bytes, tail: bool) -> bytes:
        """Page ids (int64 bytes) of the caller's slots ``theirs``, now TREE (in their order),
        without the partial tail page (``tail``: checked like the rest, then freed).

        Only slots that are not the tree's own (at their own place) reach here: they must be
        the caller's whole pages (plus one partial tail page), distinct. Tree pages are TREE,
        not OWNED, so passing them anywhere else fails here, and nothing changes. The caller
        releases the duplicates right after.
        """
        try:
            return self.device_alloc.claim(theirs, OWNED, TREE, tail)
        except Exception:
            self._drop_empty_root(root)
            raise

    def _classify(self, path: list[TreeNode], raw: bytes) -> tuple[list[bytes], list]:
        """Split the leading slots of ``raw`` (slot bytes) for the tokens ``path`` covers into
        duplicates of device nodes (to free) and slots for host-only nodes (to adopt); the
        tree's own slots are neither.

        The nodes whose pages the caller's slots are pass in one C call (compared in place,
        nothing built). A caller may pass the tree's own pages for part of a node and its own
        for the rest (an engine that recomputed the last page of a full hit): that node is then
        compared page by page.
        """
        ps = self.page_size
        dup, adopt = [], []
        i, pos = own_nodes(path, 0, 0, raw, ps)  # pos: slot index into ``raw``
        while i < len(path):
            node = path[i]
            own, n = node.device_pages, node.num_tokens
            mine = raw[8 * pos : 8 * (pos + n)]  # the caller's slots for this node
            if own is None:
                adopt.append((node, mine))
            else:  # page by page: the caller's own pages are duplicates, the tree's are not
                differ = np.frombuffer(slot_pages(mine, ps), dtype=np.int64) != np.frombuffer(
                    own, dtype=np.int64
                )
                dup.append(np.frombuffer(mine, dtype=np.int64).reshape(-1, ps)[differ].tobytes())
            i, pos = own_nodes(path, i + 1, pos + n, raw, ps)
        return dup, adopt

    def _drop_empty_root(self, root: TreeNode) -> None:
        if not root.children and root.namespace is not None:
            self.tree._roots.pop(root.namespace, None)
