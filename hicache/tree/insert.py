"""Inserter: hand a finished prefix to the tree (composed by HiRadixCache).

Index regions of one insert call (page_size 4, 14 tokens; ``|`` marks page boundaries). Nodes
hold page ids; the caller's slots are validated and turned into page ids once::

    tokens   | t0..t3 | t4..t7 | t8..t11 | t12 t13 |
    tree     | node A (device) | node B  |            walk() covers A and B (8 + 4 tokens)
    slots    | A's own pages   | dup     | tail page  |
               left alone        freed     freed (unaligned tail; the tree holds whole pages)

If B were host-only, the caller's pages for it would be adopted as its device copy instead
of freed; tokens past the covered part become one new leaf with the caller's pages.

What it touches is what its constructor takes: the tree and the device page allocator (the
caller's pages become the tree's). Three calls go back to the cache: wait for a load still
writing the prefix, offer the last node to device eviction, and what follows an insert (a
backup of hot nodes, or the third tier under the only pool). Control thread only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hicache.memory import OWNED, TREE, PagedAllocator
from hicache.tree.fastpath import own_nodes, slot_pages
from hicache.tree.node import IO_LOAD, Namespace, TreeNode
from hicache.tree.radix_tree import RadixTree


class Inserter:
    def __init__(
        self,
        tree: RadixTree,
        device_alloc: PagedAllocator,
        wait_load: Callable[[TreeNode], object],
        push_device: Callable[[TreeNode | None], None],
        after_insert: Callable[[list[TreeNode], TreeNode | None], None],
    ):
        self.tree = tree
        self.page_size = tree.page_size
        self.device_alloc = device_alloc  # the caller's pages move from OWNED to TREE here
        self.wait_load = wait_load  # block until no load writes a node or its ancestors
        self.push_device = push_device  # ``node`` may now be a device eviction candidate
        # (the path walked, the new leaf or None): backups of hot nodes, the third tier
        self.after_insert = after_insert

    def insert(self, tokens: np.ndarray, slots: np.ndarray, namespace: Namespace) -> int:
        """Insert checked ``tokens`` with the caller's ``slots``; returns the tokens the tree
        held already (HiRadixCache.insert says what happens to each slot)."""
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
            self.tree.drop_if_empty(root)
            return 0
        self.push_device(last)
        self.after_insert(path, leaf)
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
            self.tree.drop_if_empty(root)
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
