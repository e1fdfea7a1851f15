"""A KV-aware router's view of hicache, rebuilt from KV events, and the same view read off the
tree directly (the reference the events must reproduce).

``TierModel.apply`` takes our event objects and vLLM's decoded structs alike (same field names).
"""

from __future__ import annotations

import xxhash

from hicache.tree import IOState

Blocks = dict[str, dict[int, tuple[int | None, tuple[int, ...]]]]  # medium -> hash -> block


class TierModel:
    def __init__(self) -> None:
        self.blocks: Blocks = {}

    def apply(self, event: object) -> None:
        kind = type(event).__name__
        if kind == "BlockStored":
            bs, hashes, tokens = event.block_size, event.block_hashes, event.token_ids
            assert len(tokens) == bs * len(hashes), "tokens do not fill the blocks"
            if event.parent_block_hash is not None:
                assert any(event.parent_block_hash in b for b in self.blocks.values()), (
                    "a block stored under a parent nobody holds"
                )
            tier = self.blocks.setdefault(event.medium, {})
            parent = event.parent_block_hash
            for i, h in enumerate(hashes):
                tier[h] = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
                parent = h
        elif kind == "BlockRemoved":
            tier = self.blocks.get(event.medium, {})
            for h in event.block_hashes:
                assert h in tier, f"removed block {h} was never stored on {event.medium}"
                del tier[h]
        elif kind == "AllBlocksCleared":
            self.blocks.clear()
        else:
            raise AssertionError(f"unknown event {kind}")

    def normalized(self) -> Blocks:
        return {m: dict(b) for m, b in self.blocks.items() if b}


def tree_blocks(cache, device_medium: str = "GPU", host_medium: str = "CPU") -> Blocks:  # noqa: ANN001
    """Per medium, every readable page of the tree with its chained hash, computed here from
    the tokens (not from what the cache cached)."""
    ps = cache.page_size
    out: Blocks = {}
    for ns, root in cache.tree.namespace_roots():
        seed = xxhash.xxh3_64_intdigest(b"hicache-block-v1" + repr(ns).encode())
        stack = [(child, seed, None) for child in root.children.values()]
        while stack:
            node, prior, parent = stack.pop()
            tokens = node.tokens().tolist()
            hashes = []
            for i in range(0, len(tokens), ps):
                prior = xxhash.xxh3_64_intdigest(node.key[4 * i : 4 * (i + ps)], seed=prior)
                hashes.append(prior)
            mediums = []
            if node.device_pages is not None and node.io is not IOState.LOAD:
                mediums.append(device_medium)
            if node.host_pages is not None and node.io is not IOState.BACKUP:
                mediums.append(host_medium)
            for medium in mediums:
                tier = out.setdefault(medium, {})
                p = parent
                for i, h in enumerate(hashes):
                    tier[h] = (p, tuple(tokens[i * ps : (i + 1) * ps]))
                    p = h
            stack.extend((c, hashes[-1], hashes[-1]) for c in node.children.values())
    return out
