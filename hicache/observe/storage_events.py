"""StorageBlocks: the pages this node's disk holds, told as KV events on vLLM's ``STORAGE`` medium.

The tree's events (kv_events.py) come from tree nodes; the disk holds pages the tree forgot
long ago and evicts them by store key, so its events come from the one thread that makes the
disk's calls instead (the third tier's IO thread, ``hicache.l3.worker``). That thread records
each change in the order it made it: ``Held`` (pages it found on the disk or just wrote, with
their block hashes and tokens), ``Let`` (store keys the disk let go: evicted to make room, or
dropped with a prefix that failed to read) and ``Forgot`` (a flush). The control thread turns
the records into events at ``take()``, keeping ``blocks`` (store key -> block): what a consumer
that saw every event believes the disk holds. So the announced set is what the disk held at the
last record taken; it never names a page the disk let go before then.

What is not announced: pages written by an earlier daemon on the same folder until they are
read or offered again (the disk's index has no tokens), and what a remote store under the
disk holds.

The records are appended by the IO thread and popped by the control thread (a deque); the
rest is the control thread's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from hicache.observe.kv_events import BlockRemoved, BlockStored, Event, chain_hashes, namespace_seed

MEDIUM = "STORAGE"  # vLLM's name for a medium below the CPU (kv_events.MEDIUM_STORAGE)


@dataclass(frozen=True)
class Held:
    """These pages are on the disk now."""

    names: list[str]  # store keys
    hashes: list[int]  # their block hashes (kv_events.py's chain)
    parents: list[int | None]  # each page's previous block hash (None: a namespace's first)
    tokens: np.ndarray  # int32, page_size per page


@dataclass(frozen=True)
class Let:
    """The disk let these store keys go."""

    names: list[str]


@dataclass(frozen=True)
class Forgot:
    """The disk was flushed: it holds nothing."""


StorageChange = Held | Let | Forgot


def held_pages(
    key: bytes, namespace: object, first: int, at: list[int], names: list[str], page_size: int
) -> Held:
    """``Held`` for pages ``first + i`` (``i`` in ``at``; their store keys ``names``) of the
    prompt ``key`` (int32 token ids from the namespace's root)."""
    pb = 4 * page_size
    end = first + (max(at) + 1 if at else 0)
    chain = chain_hashes(key[: end * pb], pb, namespace_seed(namespace)).tolist()
    pages = [first + i for i in at]
    tokens = np.frombuffer(key[: end * pb], np.int32).reshape(-1, page_size)[pages]
    return Held(names, [chain[c] for c in pages], [chain[c - 1] if c else None for c in pages],
                tokens.reshape(-1))  # fmt: skip


class StorageBlocks:
    def __init__(self, page_size: int):
        self.page_size = page_size
        # store key -> (block hash, parent block hash, tokens): announced on STORAGE, oldest first
        self.blocks: dict[str, tuple[int, int | None, np.ndarray]] = {}
        self.changes: deque[StorageChange] | None = None  # the IO thread's records (``follow``)

    def follow(self, changes: deque[StorageChange]) -> None:
        """Take the records from ``changes`` from now on."""
        self.changes = changes

    def take(self) -> tuple[list[Event], list[Event]]:
        """(stores, removals) that bring a consumer from the last take() to the last record:
        stores of pages that left and came back since cancel their removal."""
        changes = self.changes
        if not changes:
            return [], []
        stores: list[Event] = []
        gone: dict[int, None] = {}  # block hashes removed (an ordered set)
        blocks = self.blocks
        while changes:
            change = changes.popleft()
            if isinstance(change, Held):
                stores += self._held(change, gone)
            elif isinstance(change, Let):
                for name in change.names:
                    block = blocks.pop(name, None)
                    if block is not None:
                        gone[block[0]] = None
            else:
                gone.update((block[0], None) for block in blocks.values())
                blocks.clear()
        removals: list[Event] = [BlockRemoved(list(gone), MEDIUM)] if gone else []
        return stores, removals

    def _held(self, change: Held, gone: dict[int, None]) -> list[Event]:
        """The pages of ``change`` not announced yet, as BlockStored runs (a run: pages that
        chain one to the next)."""
        ps = self.page_size
        out: list[Event] = []
        run: list[int] = []  # indices into change of the run being built

        def close() -> None:
            if run:
                tokens = change.tokens[run[0] * ps : (run[-1] + 1) * ps].tolist()
                hashes = [change.hashes[i] for i in run]
                out.append(BlockStored(hashes, change.parents[run[0]], tokens, ps, MEDIUM))
                run.clear()

        for i, name in enumerate(change.names):
            h = change.hashes[i]
            if name in self.blocks:
                close()
                continue
            self.blocks[name] = (h, change.parents[i], change.tokens[i * ps : (i + 1) * ps])
            if h in gone:  # (let go and held again since the last take: no change to announce)
                del gone[h]
                close()
                continue
            if run and change.parents[i] != change.hashes[run[-1]]:
                close()
            run.append(i)
        close()
        return out

    def dump(self) -> list[Event]:
        """BlockStored for every page announced on STORAGE, each after its parent where that
        is announced too."""
        ps = self.page_size
        by_hash = {h: (parent, tokens) for h, parent, tokens in self.blocks.values()}
        out: list[Event] = []
        done: set[int] = set()
        for h in by_hash:
            up: list[int] = []
            at: int | None = h
            while at is not None and at in by_hash and at not in done:
                up.append(at)
                done.add(at)
                at = by_hash[at][0]
            for b in reversed(up):
                parent, tokens = by_hash[b]
                out.append(BlockStored([b], parent, tokens.tolist(), ps, MEDIUM))
        return out
