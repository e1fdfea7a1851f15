"""What TREE answers: the tree's shape per namespace, or its first nodes, named as reports
name the pools (``tier_names.py``). Reads the cache; changes nothing."""

from __future__ import annotations

from typing import Any

from hicache.cache import HiRadixCache
from hicache.daemon.requests.tier_names import TierNames
from hicache.observe import tree_shape
from hicache.protocol import TreeRequest

Frames = list[Any]
Result = tuple[dict[str, Any], Frames]


def tree_reply(cache: HiRadixCache, tiers: TierNames, req: TreeRequest) -> Result:
    """The tree's shape (``req.shape``: per namespace, the ``req.top`` heaviest shared
    prefixes; the disk's own count beside it), or its first ``req.max_nodes`` nodes."""
    if req.shape:
        shape = tree_shape(cache, req.top)
        shape["namespaces"] = tiers.rows(shape["namespaces"])
        for ns in shape["namespaces"]:
            for prefix in ns["prefixes"]:
                prefix["tiers"] = tiers.letters(prefix["tiers"])
        l3 = cache.l3
        if l3 is not None and l3.store.clears:  # the disk's own count (the tree forgets)
            held = int(l3.store.describe().get("disk_held_values", 0))
            shape["disk_tokens"] = held * cache.page_size
        return shape, []
    limit = req.max_nodes
    nodes: list[dict[str, Any]] = []
    for node in cache.nodes():
        if len(nodes) == limit:
            break
        assert node.parent is not None  # (iter_nodes: no roots)
        nodes.append(
            {
                "id": node.id,
                "parent": node.parent.id,
                "tokens": node.num_tokens,
                tiers.key("device"): node.on_device,
                tiers.key("host"): node.on_host,
                "lock_ref": node.lock_ref,
                "hits": node.hit_count,
                "io": node.io.name.lower(),
            }
        )
    return {"nodes": nodes, "total": cache.num_nodes}, []
