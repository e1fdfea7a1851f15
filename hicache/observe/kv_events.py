"""TierEvents: which pages each tier holds, told as vLLM's KV-cache events.

A KV-aware router (Dynamo, llm-d, SGLang's router) keeps an index of which engine holds which
blocks on which medium, fed by vLLM's events: ``BlockStored`` (block hashes, the parent's hash,
token ids, block size, medium), ``BlockRemoved`` (hashes, medium) and ``AllBlocksCleared``.
This module turns the cache's tier changes into those events, so such a router understands
hicache without new code. It only makes plain event objects; the daemon encodes and publishes
them (daemon/observe/events.py).

**Block = page.** One block per full page of a node; its hash is a chained 64-bit hash of
the page's tokens seeded with the hash of the page before it (the first page of a namespace:
with the namespace's seed). So a hash names one prefix of one namespace, is the same after a
node split and across daemon restarts (no random salt), and a consumer can check a parent
link. Exactly: ``seed(ns) = xxh3_64(b"hicache-block-v1" + repr(ns).encode())``,
``hash(page) = xxh3_64(tokens as int32 little-endian, seed=hash(previous page))``.

**What is announced.** A page is on medium ``device`` while its device copy is readable (not
while a load writes it) and on ``host`` while its host copy is (not while a backup writes it):
so every tier change gives both events a router wants (backup -> stored on host; device
eviction -> removed from device; load-back -> stored on device; host eviction -> removed from
host). The medium names are given at construction: ``GPU``/``CPU`` for a daemon that owns a
device pool, ``CPU`` for the pool of a daemon whose engines own the device tier. Pages on
this node's disk are on ``STORAGE`` (storage_events.py: told by the disk's own thread, as the
disk keeps and evicts pages the tree no longer has).

**How.** The tree calls ``touch(node)`` whenever a node's residency may have changed (pages set
or dropped, a node added, removed or split, a copy acknowledged); ``take()`` compares each
touched node's announced state (``node.ev``) with its state now and returns the events of the
differences: stores first (parents first), then removals (children first), so a block moving
from one medium to another is held somewhere throughout; a block removed and cached anew in
the same batch is in neither. Between two
``take()`` calls an untouched node's announced state is its real one (check_integrity).

Not thread-safe: the cache's owner (the daemon's control thread) calls everything here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from hicache.tree import IO_BACKUP, IO_LOAD, TreeNode

if TYPE_CHECKING:
    from hicache.observe.storage_events import StorageBlocks

DEVICE, HOST = 1, 2  # bits of TreeNode.ev: the tiers a node's pages are announced on
SEED_PREFIX = b"hicache-block-v1"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]  # one per page, in token order
    parent_block_hash: int | None  # the page before the first one; None at a namespace's start
    token_ids: list[int]  # every token of those pages
    block_size: int  # tokens per page
    medium: str  # "GPU", "CPU"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def namespace_seed(namespace: object) -> int:
    """The hash a namespace's first page is chained from."""
    return xxhash.xxh3_64_intdigest(SEED_PREFIX + repr(namespace).encode())


def chain_hashes(key: bytes | memoryview, page_bytes: int, prior: int) -> np.ndarray:
    """The chained hashes of the whole pages of ``key`` (int32 tokens as bytes) after ``prior``."""
    out = np.empty(len(key) // page_bytes, dtype=np.uint64)
    h, view = prior, memoryview(key)
    for i in range(len(out)):
        h = xxhash.xxh3_64_intdigest(view[i * page_bytes : (i + 1) * page_bytes], seed=h)
        out[i] = h
    return out


def wanted(node: TreeNode) -> int:
    """The tiers ``node``'s pages are readable on now (0 once it left the tree)."""
    if node.parent is None:
        return 0
    bits = 0
    if node.device_pages is not None and node.io is not IO_LOAD:
        bits = DEVICE
    if node.host_pages is not None and node.io is not IO_BACKUP:
        bits |= HOST
    return bits


class TierEvents:
    def __init__(self, page_size: int, device_medium: str = "GPU", host_medium: str = "CPU"):
        self.page_size = page_size
        self.page_bytes = 4 * page_size
        self.mediums = {DEVICE: device_medium, HOST: host_medium}
        # nodes whose residency may differ from what was announced (an ordered set)
        self.dirty: dict[TreeNode, None] = {}
        # pages announced per tier bit (what a consumer that saw every event holds)
        self.announced = {DEVICE: 0, HOST: 0}
        self._seeds: dict[object, int] = {}  # namespace -> seed
        self._flushed = False  # a flush happened since the last take()
        # what this node's disk holds, on medium STORAGE (fed by the third tier's IO thread)
        from hicache.observe.storage_events import StorageBlocks  # (it imports this module)

        self.storage: StorageBlocks = StorageBlocks(page_size)

    def touch(self, node: TreeNode) -> None:
        """``node``'s residency may have changed (called by the tree and the cache)."""
        self.dirty[node] = None

    # ---- hashes -----------------------------------------------------------------------------
    def hashes(self, node: TreeNode) -> np.ndarray:
        """The block hashes of ``node``'s pages (computed once, through its ancestors)."""
        if node.ev_hashes is None:
            node.ev_hashes = chain_hashes(node.key, self.page_bytes, self._prior(node))
        return node.ev_hashes

    def _prior(self, node: TreeNode) -> int:
        parent = node.parent
        if parent is None or parent.parent is None:  # under a root
            ns = node.namespace
            seed = self._seeds.get(ns)
            if seed is None:
                seed = self._seeds[ns] = namespace_seed(ns)
            return seed
        return int(self.hashes(parent)[-1])

    def parent_hash(self, node: TreeNode) -> int | None:
        parent = node.parent
        return None if parent is None or parent.parent is None else int(self.hashes(parent)[-1])

    # ---- events -----------------------------------------------------------------------------
    def take(self) -> list[Event]:
        """The events that bring a consumer from the last take() to the cache's state now.
        After a flush that left nothing announced, they end with AllBlocksCleared."""
        if self._flushed:
            self._flushed = False
            events = self.take()
            if not any(self.announced.values()) and not self.storage.blocks:
                events.append(AllBlocksCleared())
            return events
        on_disk, off_disk = self.storage.take()
        if not self.dirty:
            return on_disk + off_disk
        changes = []
        for node in self.dirty:
            now = wanted(node)
            if now != node.ev:
                changes.append((node, node.ev, now))
        self.dirty.clear()
        stores: list[tuple[int, Event]] = []
        removals: list[Event] = []
        for bit, medium in self.mediums.items():
            new = [n for n, old, now in changes if now & bit and not old & bit]
            gone = [n for n, old, now in changes if old & bit and not now & bit]
            # children before parents: nodes that left the tree went leaves first (in the
            # order they were touched), then the rest deepest first; a node's pages last first
            left = [n for n in gone if n.parent is None]
            stay = sorted((n for n in gone if n.parent is not None), key=_depth, reverse=True)
            # (ignore: announced nodes are hashed, _stored computed their hashes)
            gone_hashes = [int(h) for n in left + stay for h in n.ev_hashes[::-1]]  # type: ignore[index]
            new_hashes = {int(h) for n in new for h in self.hashes(n)}
            again = new_hashes.intersection(gone_hashes)  # cached anew in the same batch
            for node in new:
                if not again.issuperset(int(h) for h in self.hashes(node)):  # (as computed above)
                    stores.append((_depth(node), self._stored(node, medium)))
            kept = [h for h in gone_hashes if h not in again]
            if kept:
                removals.append(BlockRemoved(kept, medium))
            self.announced[bit] += len(new_hashes) - len(gone_hashes)
        for node, _, now in changes:
            node.ev = now
        stores.sort(key=lambda pair: pair[0])  # parents before children
        # stores first: a block moving between mediums is never held by neither in between
        return [event for _, event in stores] + on_disk + removals + off_disk

    def _stored(self, node: TreeNode, medium: str) -> BlockStored:
        return BlockStored(
            self.hashes(node).tolist(),
            self.parent_hash(node),
            node.tokens().tolist(),
            self.page_size,
            medium,
        )

    def flushed(self) -> None:
        """A flush was asked for (the next take() says AllBlocksCleared if nothing is left)."""
        self._flushed = True

    def dump(self, nodes: Iterable[TreeNode]) -> list[Event]:
        """BlockStored for every announced page of ``nodes`` (the tree's, parents first): what
        a consumer late to the stream needs to hold what one that saw every event holds. Call
        it right after take(), so that it describes exactly the events taken so far."""
        out: list[Event] = []
        for node in nodes:
            for bit, medium in self.mediums.items():
                if node.ev & bit:
                    out.append(self._stored(node, medium))
        return out + self.storage.dump()


def _depth(node: TreeNode) -> int:
    depth = 0
    while node.parent is not None:
        depth += 1
        node = node.parent
    return depth
