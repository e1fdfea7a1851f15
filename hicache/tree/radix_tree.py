"""RadixTree: the structure of the cache (nodes, keys, splits, lock walks, size counters).

It knows nothing about pools or transfers; HiRadixCache drives it. Keys are int32 token ids as
little-endian bytes, so comparing a node against a query is one ``bytes ==`` (a memcmp) instead
of a Python loop over tokens; numpy is used only to find where a mismatch is. A child is found
by the bytes of its first page. Each namespace has its own root, so namespaces never share a
prefix and child keys need no namespace tag.

Size counters follow SGLang's definition: ``evictable_tokens`` are device tokens in unlocked
nodes, ``protected_tokens`` device tokens in locked nodes; the lock walks keep them exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal, overload

import numpy as np

from hicache.tree.fastpath import common_tokens, descend
from hicache.tree.node import Namespace, TreeNode

MAX_NAMESPACE = 1024  # characters of a str namespace, bytes of a bytes one


class RadixTree:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.page_bytes = 4 * page_size  # bytes of one page of int32 tokens
        self._roots: dict[Namespace, TreeNode] = {}
        self._next_id = 0
        self.clock = 0  # logical time: +1 per match or insert
        self.evictable_tokens = 0  # device tokens in nodes with lock_ref == 0
        self.protected_tokens = 0  # device tokens in nodes with lock_ref > 0
        self.num_nodes = 0  # nodes in the tree, roots excluded
        # called with each node whose residency may have changed (KV events), or None
        self.on_change: Callable[[TreeNode], None] | None = None
        # the root of namespace None, the one most matches start from (no lookup)
        self.default_root = self._roots[None] = self._new_node(b"", None, None)

    # ---- nodes ----------------------------------------------------------------------------
    def _new_node(self, key: bytes, parent: TreeNode | None, namespace: Namespace) -> TreeNode:
        node = TreeNode(self._next_id, key, parent, namespace)
        node.created = node.last_access = self.clock
        self._next_id += 1
        return node

    @overload
    def root(self, namespace: Namespace, create: Literal[True]) -> TreeNode: ...
    @overload
    def root(self, namespace: Namespace, create: bool = False) -> TreeNode | None: ...
    def root(self, namespace: Namespace, create: bool = False) -> TreeNode | None:
        """The root of ``namespace`` (created on demand when ``create``)."""
        if namespace is None:
            return self.default_root
        if not isinstance(namespace, (str, int, bytes)) or isinstance(namespace, bool):
            raise ValueError(f"namespace must be str, int, bytes or None, got {namespace!r:.60}")
        if not isinstance(namespace, int) and len(namespace) > MAX_NAMESPACE:
            raise ValueError(f"namespace: at most {MAX_NAMESPACE} characters or bytes")
        if isinstance(namespace, int) and not -(2**63) <= namespace < 2**64:
            raise ValueError("namespace: an int namespace must fit 64 bits")
        root = self._roots.get(namespace)
        if root is None and create:
            root = self._roots[namespace] = self._new_node(b"", None, namespace)
        return root

    def roots(self) -> list[TreeNode]:
        return list(self._roots.values())

    def drop_if_empty(self, root: TreeNode) -> None:
        """Forget a namespace's root that has no children left (the default root stays)."""
        if not root.children and root.namespace is not None:
            self._roots.pop(root.namespace, None)

    def namespace_roots(self) -> list[tuple[Namespace, TreeNode]]:
        """(namespace, root) of every namespace that holds nodes (and the default one)."""
        return list(self._roots.items())

    def in_tree(self, node: TreeNode) -> bool:
        """Whether ``node`` is a live non-root node of this tree."""
        return node.parent is not None and self._roots.get(node.namespace) is not None

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- walking ----------------------------------------------------------------------------
    def walk(self, root: TreeNode, key: bytes) -> tuple[list[TreeNode], int]:
        """Nodes covered by ``key`` from ``root``, and how many key bytes they cover.

        ``key`` may end in a partial page, which is never covered (every node's key is whole
        pages; a child is found by a whole first page). A node matched only in part is split
        first, so the path always ends on a node boundary. Mutates: splits and access times
        (not hit counts).
        """
        self.clock = now = self.clock + 1
        path, pos = descend(root, key, 0, self.page_bytes, now)
        if len(key) - pos >= self.page_bytes:  # (a partial page left finds no child)
            parent = path[-1] if path else root
            child = parent.children.get(key[pos : pos + self.page_bytes])
            if child is not None:  # diverges (or the key ends) inside it: cut at the last page
                child = self.split(child, self._common_bytes(child.key, key, pos))
                child.last_access = now
                path.append(child)
                pos += len(child.key)
        return path, pos

    def _common_bytes(self, node_key: bytes, key: bytes, pos: int) -> int:
        """Bytes of whole pages that ``node_key`` and ``key[pos:]`` share (>= one page)."""
        return common_tokens(node_key, key, pos) // self.page_size * self.page_bytes

    def split(self, node: TreeNode, nbytes: int) -> TreeNode:
        """Cut ``node`` after ``nbytes`` of key; returns the new upper half (its new parent).

        The upper half inherits every field (locks, host protection, hits, times, transfer
        state), because everything that covered the node covers both halves. Counters do not
        change: tokens are only regrouped.
        """
        assert 0 < nbytes < len(node.key) and nbytes % self.page_bytes == 0
        pages = nbytes // self.page_bytes
        upper = self._new_node(node.key[:nbytes], node.parent, node.namespace)
        for field in TreeNode.SHARED:
            setattr(upper, field, getattr(node, field))
        for field, per_page in TreeNode.PAGED.items():
            whole = getattr(node, field)
            if whole is not None:
                cut = per_page * pages
                setattr(upper, field, whole[:cut])
                setattr(node, field, whole[cut:])
        for work in (node.transfer, node.l3):  # a transfer or an L3 write reads both halves
            if hasattr(work, "nodes"):
                work.nodes.append(upper)
        assert upper.parent is not None  # (a root is never split: its key is empty)
        upper.parent.children[node.key[: self.page_bytes]] = upper
        node.key = node.key[nbytes:]
        node.parent = upper
        upper.children[node.key[: self.page_bytes]] = node
        self.num_nodes += 1
        if self.on_change is not None:
            self.on_change(upper)  # as dirty as the node it was cut from
        return upper

    # ---- adding and removing ----------------------------------------------------------------
    def add_leaf(self, parent: TreeNode, key: bytes, device_pages: bytes) -> TreeNode:
        """A new unlocked device leaf under ``parent`` (page ids as int64 bytes, one per key
        page). Counts its tokens as evictable."""
        leaf = self._new_node(key, parent, parent.namespace)
        leaf.device_pages = device_pages
        leaf.hit_count = 1
        parent.children[key[: self.page_bytes]] = leaf
        self.evictable_tokens += leaf.num_tokens
        self.num_nodes += 1
        if self.on_change is not None:
            self.on_change(leaf)
        return leaf

    def add_host_leaf(self, parent: TreeNode, key: bytes, host_pages: np.ndarray) -> TreeNode:
        """A new host-only leaf under ``parent`` (pages brought from the third tier)."""
        leaf = self._new_node(key, parent, parent.namespace)
        leaf.host_pages = host_pages
        leaf.hit_count = 1
        parent.children[key[: self.page_bytes]] = leaf
        self.num_nodes += 1
        if self.on_change is not None:
            self.on_change(leaf)
        return leaf

    def remove_leaf(self, node: TreeNode) -> None:
        """Detach a childless node with no pages left. Drops an empty non-default root."""
        assert not node.children and node.device_pages is None and node.host_pages is None
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[: self.page_bytes]]
        node.parent = None
        self.num_nodes -= 1
        if self.on_change is not None:
            self.on_change(node)
        if parent.parent is None and not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]

    # ---- device residency and locks ---------------------------------------------------------
    def set_device(self, node: TreeNode, pages: bytes | None) -> None:
        """Attach or drop a node's device pages (int64 bytes), keeping the size counters exact."""
        had = node.device_pages is not None
        node.device_pages = pages
        if self.on_change is not None:
            self.on_change(node)
        delta = node.num_tokens * ((pages is not None) - had)
        if node.lock_ref:
            self.protected_tokens += delta
        else:
            self.evictable_tokens += delta

    def inc_lock(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors; returns the change of evictable tokens (<= 0)."""
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                delta -= node.num_tokens
            node.lock_ref += 1
            node = node.parent
        self.evictable_tokens += delta
        self.protected_tokens -= delta
        return delta

    def dec_lock(self, node: TreeNode) -> int:
        """Undo one inc_lock; returns the change of evictable tokens (>= 0)."""
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 1:
                delta += node.num_tokens
            node.lock_ref -= 1
            node = node.parent
        self.evictable_tokens += delta
        self.protected_tokens -= delta
        return delta
