"""tree_shape: what the tree holds per namespace, and its heaviest shared prefixes (read-only).

An operator's view (`hicache tree`): a few lines however large the tree. A *prefix* here is
the path from a namespace's root to a node where the tree branches (or a first-level node):
the system prompts, documents and conversations that requests share. Ranked by the tokens
cached below them. Linear in the tree; only the top ``top`` per namespace are kept. Tiers: ``D``
device, ``H`` host, ``S`` stored in the tier under the pool (the disk, or a store), as the tree
last knew: written there or read from it (the disk may have evicted it since; the tree never
holds what only the disk holds: its own count is the daemon's ``disk_tokens``).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hicache.tree import RadixTree, TreeNode

HEAD_TOKENS = 8  # first tokens shown per prefix


class HasTree(Protocol):
    """What the view reads: a cache's tree (HiRadixCache; the view never needs the rest)."""

    tree: RadixTree


def tree_shape(cache: HasTree, top: int = 10) -> dict[str, Any]:
    """Per namespace: nodes, tokens by tier, hits, and the ``top`` prefixes by tokens below."""
    namespaces = []
    truncated = False
    for ns, root in sorted(
        cache.tree.namespace_roots(), key=lambda kv: (kv[0] is not None, repr(kv[0]))
    ):
        below: dict[int, int] = {}  # node id -> tokens in its subtree (itself included)
        order = _post_order(root)
        totals = dict.fromkeys(
            ("nodes", "tokens", "device_tokens", "host_tokens", "stored_tokens", "hits"), 0
        )
        for node in order:
            n = node.num_tokens
            below[node.id] = n + sum(below[c.id] for c in node.children.values())
            totals["nodes"] += 1
            totals["tokens"] += n
            totals["device_tokens"] += n if node.device_pages is not None else 0
            totals["host_tokens"] += n if node.host_pages is not None else 0
            totals["stored_tokens"] += n if node.l3 is True else 0
            totals["hits"] += node.hit_count if node.parent is root else 0
        candidates = [node for node in order if node.parent is root or len(node.children) >= 2]
        best = heapq.nlargest(top, candidates, key=lambda node: (below[node.id], -node.id))
        truncated |= len(candidates) > top
        namespaces.append(
            # "" for the default namespace (None), the repr of any other
            {
                "namespace": "" if ns is None else repr(ns),
                **totals,
                "prefixes": [_prefix(n, below) for n in best],
            }
        )
    return {
        "nodes": cache.tree.num_nodes,
        "tokens": sum(ns["tokens"] for ns in namespaces),
        "top": top,
        "truncated": truncated,
        "namespaces": [ns for ns in namespaces if ns["nodes"]],
    }


def _post_order(root: TreeNode) -> list[TreeNode]:
    """Every node under ``root``, children before parents (root excluded)."""
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    out.reverse()
    return out


def _prefix(node: TreeNode, below: dict[int, int]) -> dict[str, Any]:
    length, first, up = node.num_tokens, node, node.parent
    assert up is not None  # (_post_order: no roots)
    while up.parent is not None:  # up to the first-level node (its parent: a root)
        first, up = up, up.parent
        length += first.num_tokens
    tiers = (
        ("D" if node.device_pages is not None else "")
        + ("H" if node.host_pages is not None else "")
        + ("S" if node.l3 is True else "")
    )
    return {
        "prefix_tokens": length,
        "subtree_tokens": below[node.id] - node.num_tokens,
        "branches": len(node.children),
        "hits": node.hit_count,
        "tiers": tiers,
        "head": first.tokens()[:HEAD_TOKENS].tolist(),
    }
