"""TransferBook: backups, load-backs and their acknowledgements (composed by HiRadixCache).

Every copy in flight has a TransferRecord keyed by its ticket. While it exists:

- BACKUP: each node has io=BACKUP and both page arrays; its device pages are read, its host
  pages written. A backup started by a hit locks each node (``locked``); one started by
  eviction does not, and frees the device pages at the ack instead (``evict_on_ack``).
- LOAD: each node of the chain has io=LOAD, host_ref+1 (its host pages are read) and device
  pages being written; the chain's last node holds one lock (``locked``).

Nothing is freed or unlocked until ``poll`` has seen the ack.

What it touches is what its constructor takes: the tree (io states, locks), both page
allocators, the transfer engine, the write policy, the counters and the callers' locks (a
failed load moves them); it asks tiering for pages (evicting for room) and to re-queue or drop
nodes as copies end, and tells the third tier (``l3``, once attached) what a backup made
durable. Control thread only.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache.config import HiCacheConfig
from hicache.memory import PagedAllocator, PageState
from hicache.observe import BYTES, SECONDS, Counters, Histogram
from hicache.transfers.engine import Ack, Direction, TransferEngine
from hicache.tree import IOState, MovedLocks, RadixTree, TreeNode
from hicache.types import Ticket
from hicache.write_policy import WritePolicy

if TYPE_CHECKING:
    from hicache.cache_view import Room
    from hicache.l3 import L3Tier

log = logging.getLogger("hicache.cache")


@dataclass
class TransferRecord:
    ticket: Ticket
    direction: Direction
    nodes: list[TreeNode]  # nodes whose io state this copy owns; grows when one is split
    locked: list[TreeNode]  # nodes holding one device lock each until the ack
    tokens: int  # tokens copied
    evict_on_ack: bool = False  # backup for eviction: drop the device pages once acked
    layers: int = 0  # layers acknowledged (loads), for wait_layer
    started: float = field(default_factory=time.perf_counter)  # when it was submitted
    extra: dict = field(default_factory=dict)


def _split_pages(pages: np.ndarray, nodes: list[TreeNode], page_size: int) -> list[np.ndarray]:
    bounds = np.cumsum([n.num_tokens // page_size for n in nodes])[:-1]
    return np.split(pages, bounds)


class TransferBook:
    def __init__(
        self,
        config: HiCacheConfig,
        tree: RadixTree,
        device_alloc: PagedAllocator,
        host_alloc: PagedAllocator | None,
        engine: TransferEngine | None,
        write_policy: WritePolicy,
        counters: Counters,
        tiering: Room,
        user_locks: Counter[TreeNode],
        moved_locks: MovedLocks,
    ):
        self.config = config
        self.page_size = config.page_size
        self.tree = tree
        self.device_alloc = device_alloc
        self.host_alloc = host_alloc  # None: no host tier (and no engine)
        self.engine = engine  # the copies; None without a host tier
        self.write_policy = write_policy  # which hits back up
        self.counters = counters
        self.tiering = tiering  # pages (evicting for room), candidates, drops
        self.user_locks = user_locks  # inc_lock_ref calls not yet undone, per node
        self.moved_locks = moved_locks  # locks a failed load moved to its anchor
        self.l3: L3Tier | None = None  # the store under the host pool (attach_l3)
        self.records: dict[Ticket, TransferRecord] = {}  # copies submitted, not acknowledged
        # per direction ("backup", "load"): seconds from submit to ack, and bytes per copy
        self.transfer_seconds = {d: Histogram(SECONDS) for d in ("backup", "load")}
        self.transfer_bytes = {d: Histogram(BYTES) for d in ("backup", "load")}

    # ---- backup ---------------------------------------------------------------------------
    def backup_hot(self, nodes: list[TreeNode]) -> None:
        """Back up the device nodes whose hits reached the policy's threshold."""
        if self.host_alloc is None:
            return
        wants = self.write_policy.wants_backup
        hot = [
            n
            for n in nodes
            if n.host_pages is None and n.device_pages is not None and wants(n.hit_count)
        ]
        if hot:
            self.backup(hot, evict_on_ack=False)

    def backup(self, nodes: list[TreeNode], evict_on_ack: bool) -> bool:
        """Start one copy of ``nodes`` to fresh host pages; False (nothing changed) when the
        host pool is full even after host eviction."""
        ps = self.page_size
        tokens = sum(n.num_tokens for n in nodes)
        host = self.tiering.alloc_host_pages(tokens // ps, PageState.TREE)
        if host is None:
            self.counters.backup_failed_tokens += tokens
            return False
        device = np.concatenate([n.device_page_ids() for n in nodes])
        assert self.engine is not None  # (made with the host tier)
        ticket = self.engine.submit(Direction.BACKUP, device, host)
        locked = [] if evict_on_ack else list(nodes)
        record = TransferRecord(ticket, Direction.BACKUP, list(nodes), locked, tokens, evict_on_ack)
        for node, pages in zip(nodes, _split_pages(host, nodes, ps), strict=True):
            node.host_pages, node.io, node.transfer = pages, IOState.BACKUP, record
        for node in locked:
            self.tree.inc_lock(node)
        self.records[ticket] = record
        return True

    # ---- load-back ------------------------------------------------------------------------
    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> torch.Tensor | None:
        """Start loading the host-only chain that ends at ``node`` back to the device.

        All or nothing: returns the device slots of the whole chain (in token order), or None
        when the chain is shorter than load_back_threshold, longer than ``mem_quota`` tokens, or
        the device cannot make room. An empty tensor when ``node`` already is on the device.
        The chain stays locked, and its host pages protected, until the ack; wait_load(node)
        before reading the slots.
        """
        if node.parent is None:
            return torch.empty(0, dtype=torch.int64)
        if not self.tree.in_tree(node):
            raise ValueError(f"load_back: {node!r} is not a node of this cache")
        self.counters.load_back_calls += 1
        chain, anchor = [], node
        while anchor.parent is not None and anchor.device_pages is None:
            chain.append(anchor)
            anchor = anchor.parent
        if not chain:
            return torch.empty(0, dtype=torch.int64)
        if self.load_ticket(anchor) is not None:
            # a load still writes the anchor's prefix: let it land first, so that a load never
            # stacks on another whose copy may yet fail (and take the anchor off the device)
            self.wait_load(anchor)
            return self.load_back(node, mem_quota)
        chain.reverse()
        tokens = sum(n.num_tokens for n in chain)
        if tokens < self.config.load_back_threshold or (
            mem_quota is not None and tokens > mem_quota
        ):
            return None
        return self._start_load(chain, anchor, tokens)

    def _start_load(
        self, chain: list[TreeNode], anchor: TreeNode, tokens: int
    ) -> torch.Tensor | None:
        for n in chain:  # protect the host pages first: making room may evict on both tiers
            n.host_ref += 1
        self.tree.inc_lock(anchor)
        device = self.tiering.alloc_device(tokens // self.page_size, PageState.TREE)
        self.tree.dec_lock(anchor)
        if device is None:
            for n in chain:  # (making room may have popped them from the host heap meanwhile)
                n.host_ref -= 1
                self.tiering.push_host(n)
            self.tiering.push_device(anchor)
            return None
        host = np.concatenate([n.host_pages for n in chain])
        assert self.engine is not None  # (a host-only chain: there is a host tier)
        ticket = self.engine.submit(Direction.LOAD, device, host)
        record = TransferRecord(ticket, Direction.LOAD, list(chain), [chain[-1]], tokens)
        for n, mine in zip(chain, _split_pages(device, chain, self.page_size), strict=True):
            self.tree.set_device(n, mine.astype("<i8", copy=False).tobytes())
            n.io, n.transfer = IOState.LOAD, record
        self.tree.inc_lock(chain[-1])
        self.records[ticket] = record
        slots = self.device_alloc.slots_of_pages(device)
        return torch.from_numpy(slots.copy())  # never alias the engine's page array

    def load_ticket(self, node: TreeNode) -> Ticket | None:
        """Ticket of the load still writing ``node`` or an ancestor (the deepest), if any."""
        while node.parent is not None:
            if node.io is IOState.LOAD:
                assert node.transfer is not None  # (io=LOAD: the load's record)
                return node.transfer.ticket
            node = node.parent
        return None

    def wait_load(self, node: TreeNode, timeout: float | None = None) -> bool:
        """Block until no load is writing ``node`` or its ancestors; processes acks."""
        tickets = set()
        while node.parent is not None:
            if node.io is IOState.LOAD:
                assert node.transfer is not None  # (io=LOAD: the load's record)
                tickets.add(node.transfer.ticket)
            node = node.parent
        if not tickets:
            return True
        assert self.engine is not None  # (a load in flight: there is a host tier)
        done = self.engine.wait(tickets, timeout)
        self.poll()
        return done

    # ---- acknowledgements ---------------------------------------------------------------------
    def settle(self) -> bool:
        """Wait for every copy in flight and process the acks; False when none was."""
        if not self.records:
            return False
        assert self.engine is not None  # (copies in flight: there is a host tier)
        self.engine.wait(list(self.records))
        self.poll()
        return True

    def poll(self) -> int:
        """Process every ack the transfer engine has; returns how many."""
        if self.engine is None:
            return 0
        acks = self.engine.poll()
        for ack in acks:
            self._on_ack(ack)
        return len(acks)

    def _on_ack(self, ack: Ack) -> None:
        record = self.records.pop(ack.ticket)
        touch = self.tree.on_change
        for node in record.nodes:
            node.io, node.transfer = IOState.NONE, None
            if touch is not None:  # its copy became readable, or failed
                touch(node)
        if not ack.ok:
            self.counters.transfer_errors += 1
        way = "backup" if record.direction is Direction.BACKUP else "load"
        self.transfer_seconds[way].observe(time.perf_counter() - record.started)
        self.transfer_bytes[way].observe(record.tokens * self.config.token_bytes)
        if record.direction is Direction.BACKUP:
            self._backup_done(record, ack.ok)
        else:
            self._load_done(record, ack.ok)
            if ack.corrupt:
                self._drop_corrupt_chain(record, ack.error)

    def _backup_done(self, record: TransferRecord, ok: bool) -> None:
        for node in record.locked:
            self.tree.dec_lock(node)
        if not ok:  # the host copy is garbage: forget it, the device copy is intact
            assert self.host_alloc is not None  # (a backup: there is a host tier)
            for node in record.nodes:
                assert node.host_pages is not None  # (the backup's)
                self.host_alloc.release(node.host_pages)
                node.host_pages = None
            self.counters.backup_failed_tokens += record.tokens
        else:
            self.counters.backup_tokens += record.tokens
            self.counters.backup_bytes += record.tokens * self.config.token_bytes
        for node in sorted(record.nodes, key=lambda n: -self._depth(n)):
            if ok and record.evict_on_ack and self.tiering.device_candidate(node):
                self.counters.evicted_device_tokens += self.tiering.drop_device(node)
            else:
                self.tiering.push_device(node)
        if ok and self.l3 is not None:  # their host copies exist: the store may take them
            self.l3.after_backup(sorted(record.nodes, key=self._depth))

    def _load_done(self, record: TransferRecord, ok: bool) -> None:
        for node in record.nodes:
            node.host_ref -= 1
        for node in record.locked:
            self.tree.dec_lock(node)
        if ok:
            self.counters.load_tokens += record.tokens
            self.counters.load_bytes += record.tokens * self.config.token_bytes
        else:
            self._drop_failed_load(record)
        for node in record.nodes:  # (a host heap pop during the load dropped their entries)
            self.tiering.push_device(node)
            self.tiering.push_host(node)

    def _drop_failed_load(self, record: TransferRecord) -> None:
        """A failed load's device pages hold garbage: every node of the chain loses its device
        copy now, locked or not (it stays host-only, its host copy intact), and the pages go
        back to the free list. Locks callers hold on those nodes move to the chain's anchor,
        the device node the chain hangs from (locks.py). Nothing below the chain is on the
        device: inserts and loads through a loading node wait for its ack first."""
        nodes = sorted(record.nodes, key=lambda n: -self._depth(n))  # deepest first
        anchor = nodes[-1].parent
        for node in nodes:
            held = self.user_locks.pop(node, 0)
            for _ in range(held):
                self.tree.dec_lock(node)
            if held:
                assert anchor is not None  # (the device node or root the chain hangs from)
                self.moved_locks.add(node, anchor, held)
                if anchor.parent is not None:
                    self.user_locks[anchor] += held
                    for _ in range(held):
                        self.tree.inc_lock(anchor)
            assert node.lock_ref == 0, f"{node}: locked below a failed load"
            self.tiering.drop_device(node)

    def _drop_corrupt_chain(self, record: TransferRecord, error: str) -> None:
        """A load found host pages that changed since they were written (verify_pages): after
        the failed load's own undo (its device copies dropped), the chain's host copies are
        garbage too, so each of its nodes leaves the tree with the host-only nodes below it.
        The engine that asked gets no KV from it and recomputes."""
        dropped = 0
        for node in sorted(record.nodes, key=lambda n: -self._depth(n)):  # deepest first
            if not self.tree.in_tree(node) or node.device_pages is not None:
                continue
            self.tiering.drop_host_subtrees(node)
            parent = node.parent
            self.tiering.release_host(node, to_l3=False)
            node.host_pages = None
            self.tree.remove_leaf(node)
            self.tiering.push_device(parent)
            self.tiering.push_host(parent)
            dropped += node.num_tokens
        self.counters.corrupt_host_tokens += dropped
        self.counters.evicted_host_tokens += dropped
        log.warning("dropped %d host tokens whose pages changed since written: %s", dropped, error)

    @staticmethod
    def _depth(node: TreeNode) -> int:
        depth = 0
        while node.parent is not None:
            depth, node = depth + 1, node.parent
        return depth
