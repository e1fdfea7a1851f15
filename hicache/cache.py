"""HiRadixCache: the two-tier radix cache (device pool + host pool) that everything builds on.

Not thread-safe: one thread (the daemon's control loop, or an engine) calls every method;
only the transfer engine copies on threads of its own. It composes its parts, each handed
the state it touches: ``Tiering`` (eviction, allocation that makes room: ``tiering.py``),
``TransferBook`` (backups, loads and their acks: ``transfers/book.py``) and ``Inserter`` (the
insert path: ``tree/insert.py``); matches, locks and allocation are its own. The invariant
checks (``integrity.py``) and the third tier see it through ``cache_view.py``'s interfaces
(its parts by name: ``tree``, ``tiering``); the daemon through the public methods, the
operations and queries near the end of the class included.

Who owns a device page: the free list, exactly one caller (after alloc, until insert or free),
or the tree (after insert). Pages the tree hands to a copy stay the tree's until the copy's ack.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache.config import HiCacheConfig
from hicache.integrity import check_cache_integrity
from hicache.memory import Backing, DevicePool, HostPool, PagedAllocator, PageState, PageSums
from hicache.observe import CacheStats, Counters
from hicache.tiering import Tiering
from hicache.transfers import (
    Copier,
    ThreadTransferEngine,
    TransferBook,
    TransferEngine,
    make_copier,
)
from hicache.tree import (
    IO_LOAD,
    Inserter,
    LeafHeap,
    MovedLocks,
    Namespace,
    RadixTree,
    TokenIds,
    TreeNode,
    as_slots,
    as_tokens,
    check_token_bytes,
    make_priority,
    tally,
)
from hicache.types import EvictResult, MatchResult, Ticket
from hicache.write_policy import make_write_policy

if TYPE_CHECKING:
    from hicache.l3 import L3Tier
    from hicache.observe import TierEvents
    from hicache.transfers import LayerProgress
    from hicache.transfers.book import TransferRecord

EngineFactory = Callable[[DevicePool, HostPool, Copier], TransferEngine]


def default_engine(config: HiCacheConfig) -> EngineFactory:
    """A worker thread for CPU pools; CUDA streams for GPU pools."""
    if config.device == "cpu":
        return ThreadTransferEngine
    from hicache.transfers import CudaTransferEngine  # imports torch.cuda only when needed

    return CudaTransferEngine


class HiRadixCache:
    """Prefix cache over token ids with a device pool, an optional host pool and policies."""

    def __init__(
        self,
        config: HiCacheConfig,
        device_backing: Backing | None = None,
        host_backing: Backing | None = None,
        transfer_engine: EngineFactory | None = None,
    ):
        self.config = config
        self.page_size = ps = config.page_size
        self.tree = RadixTree(ps)
        self.counters = Counters()
        self.device_pool = DevicePool(config, device_backing)
        self.device_alloc = PagedAllocator(self.device_pool.num_pages, ps, reserved_pages=1)
        self.host_pool: HostPool | None = None
        self.host_alloc: PagedAllocator | None = None
        self.engine: TransferEngine | None = None
        if config.host_enabled:
            try:
                self.host_pool = HostPool(config, host_backing)
            except BaseException:
                self.device_pool.close()
                raise
            self.host_alloc = PagedAllocator(self.host_pool.num_pages, ps)
            factory = transfer_engine or default_engine(config)
            self.engine = factory(self.device_pool, self.host_pool, make_copier(config))
            if config.verify_pages:
                self.engine.sums = PageSums(self.host_pool.page_view)
        priority = make_priority(config)
        self.device_heap = LeafHeap(priority)  # device eviction candidates
        self.host_heap = LeafHeap(priority)  # host eviction candidates
        self.user_locks: Counter[TreeNode] = Counter()  # inc_lock_ref calls not yet undone
        self.moved_locks = MovedLocks()  # user locks moved off nodes a failed load dropped
        self.write_policy = make_write_policy(config)
        self.events: TierEvents | None = None  # KV events of tier changes (attach_events)
        self.book: TransferBook  # backups, loads and their acks (made by tiering, below)

        def book_for(room: Tiering) -> TransferBook:  # (each calls the other: tiering makes it)
            self.book = TransferBook(
                config,
                self.tree,
                self.device_alloc,
                self.host_alloc,
                self.engine,
                self.write_policy,
                self.counters,
                room,
                self.user_locks,
                self.moved_locks,
            )
            return self.book

        self.tiering = Tiering(
            self.tree,
            self.device_alloc,
            self.host_alloc,
            self.device_heap,
            self.host_heap,
            self.write_policy,
            self.counters,
            book_for,
        )
        self.inserter = Inserter(
            self.tree,
            self.device_alloc,
            self.book.wait_load,
            self.tiering.push_device,
            self._after_insert,
        )
        self._l3: L3Tier | None = None  # the store under the host tier (attach_l3)

    # ---- allocation (device pool) ---------------------------------------------------------
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` device slots (whole pages, owned by the caller) or None.

        Evicts when the pool is short; None only when even eviction cannot make room.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"alloc: num_tokens must be a non-negative int, got {num_tokens!r}")
        pages = self.tiering.alloc_device(-(-num_tokens // self.page_size), PageState.OWNED)
        if pages is None:
            return None
        return torch.from_numpy(self.device_alloc.slots_of_pages(pages, num_tokens))

    def alloc_extend(self, prefix_lens, seq_lens, last_loc) -> torch.Tensor | None:  # noqa: ANN001
        """SGLang's alloc_extend: slots for tokens [prefix_len, seq_len) of each request."""
        p, s, last = (
            as_slots(x, n)
            for x, n in (
                (prefix_lens, "prefix_lens"),
                (seq_lens, "seq_lens"),
                (last_loc, "last_loc"),
            )
        )
        if not (len(p) == len(s) == len(last)) or (p > s).any() or (p < 0).any():
            raise ValueError("alloc_extend: need equal lengths and 0 <= prefix_len <= seq_len")
        self._check_partial_pages(p, last)
        need = self.device_alloc.extend_pages_needed(p, s)
        if self.device_alloc.free_pages < need:
            self.tiering.make_device_room(need)
        out = self.device_alloc.alloc_extend(p, s, last)
        return None if out is None else torch.from_numpy(out)

    def alloc_decode(self, seq_lens, last_loc) -> torch.Tensor | None:  # noqa: ANN001
        """SGLang's alloc_decode: one slot per request for its token ``seq_len - 1``."""
        s, last = as_slots(seq_lens, "seq_lens"), as_slots(last_loc, "last_loc")
        if len(s) != len(last) or (s < 1).any():
            raise ValueError("alloc_decode: need equal lengths and seq_len >= 1")
        self._check_partial_pages(s - 1, last)
        need = int(((s - 1) % self.page_size == 0).sum())
        if self.device_alloc.free_pages < need:
            self.tiering.make_device_room(need)
        out = self.device_alloc.alloc_decode(s, last)
        return None if out is None else torch.from_numpy(out)

    def _check_partial_pages(self, filled: np.ndarray, last_loc: np.ndarray) -> None:
        """A request that continues a partly filled page must own that page, and ``last_loc``
        must be where its last token sits in it (offset ``(filled - 1) % page_size``): the
        slots after it are then in the same page, never in the next one."""
        partial = filled % self.page_size != 0
        if partial.any():
            last = last_loc[partial]
            pages = self.device_alloc.pages_of_slots(last)  # range-checked
            self.device_alloc.check_pages(np.unique(pages), PageState.OWNED)
            if ((last + 1) % self.page_size != filled[partial] % self.page_size).any():
                raise ValueError(
                    "last_loc: not the slot of the request's last token (its offset in the "
                    "page must be (len - 1) % page_size); the next slots would leave the page"
                )

    def free(self, indices: object) -> None:
        """Return caller-owned slots; every page they touch is freed. Raises if any is not owned
        (double free, padding slot, out of range, or in the tree) and then frees nothing."""
        slots = as_slots(indices, "indices")
        pages = self.device_alloc.pages_of_slots(slots)
        self.device_alloc.free_pages_checked(pages, PageState.OWNED)

    def free_group_begin(self) -> None:
        self.device_alloc.free_group_begin()

    def free_group_end(self) -> None:
        self.device_alloc.free_group_end()

    # ---- match -------------------------------------------------------------------------------
    def match_prefix(self, token_ids: TokenIds, namespace: Namespace = None) -> MatchResult:
        """Longest cached prefix of ``token_ids`` (whole pages) in ``namespace``.

        Mutates: may split the last matched node, stamps access times, counts hits, and may
        start backups (write_through_selective). Locks nothing: lock ``last_device_node`` to
        keep ``device_indices`` valid. When ``loading`` is true, a load still writes part of the
        prefix: call wait_load(last_device_node) and match again (the load may have failed,
        and then that part is on the host only).
        """
        return self.match_key(as_tokens(token_ids).tobytes(), namespace, True)

    def match_key(
        self, key: bytes, namespace: Namespace = None, checked: bool = False, count: bool = True
    ) -> MatchResult:
        """match_prefix for token ids already packed as int32 little-endian bytes (the wire
        form): no array on the way. Raises ValueError for a ragged key or a negative id;
        ``checked=True``: the caller validated the ids already (one pass over a whole batch).
        ``count=False``: a look-up that is not a request (after an insert): no hit counters,
        no backups after hits."""
        if not checked:
            check_token_bytes(key)
        # a look-up that is not a request counts into a scratch object nobody reads
        counters, tree = self.counters if count else Counters(), self.tree
        counters.match_calls += 1
        root = tree.default_root if namespace is None else tree.root(namespace)
        num_tokens = len(key) >> 2
        aligned = num_tokens // self.page_size * self.page_size
        if root is None or aligned == 0:
            counters.miss_tokens += num_tokens
            node = root or tree.default_root
            return MatchResult([], self.page_size, 0, node, 0, node, False)
        # no copy cut to whole pages: tree keys are whole pages, so the walk never covers the
        # partial tail page (radix_tree.walk)
        path, covered = tree.walk(root, key)
        # chunks: the device nodes' immutable page ids (joined only if the caller asks);
        # unbacked: one has no host copy (a backup may be due); loading: a load still writes one
        chunks, page_bytes, unbacked, loading = tally(path, IO_LOAD)
        n_dev = len(chunks)  # device residency is prefix-closed: the device nodes come first
        last_dev = path[n_dev - 1] if n_dev else root  # no heap push: pops re-key touched nodes
        last_host = path[-1] if len(path) > n_dev else last_dev
        if unbacked and count and self.host_alloc is not None:
            if self.write_policy.backup_threshold:
                self._backup_after_hit(path, n_dev)
        if self.l3 is not None and count and self.l3.selective:
            self.l3.after_hit(path)
        dev_len, covered = (page_bytes >> 3) * self.page_size, covered >> 2
        counters.hit_device_tokens += dev_len
        counters.hit_host_tokens += covered - dev_len
        counters.miss_tokens += num_tokens - covered
        return MatchResult(
            chunks, self.page_size, dev_len, last_dev, covered - dev_len, last_host, loading
        )

    def _backup_after_hit(self, path: list[TreeNode], n_dev: int) -> None:
        """write_through_selective: back up the hit's device nodes that reached the threshold."""
        host = path[n_dev:]
        for node in host:  # keep the host part alive while a backup may evict host leaves
            node.host_ref += 1
        self.book.backup_hot(path[:n_dev])
        for node in host:  # (a host heap pop during the backups dropped their entries)
            node.host_ref -= 1
            self.tiering.push_host(node)

    # ---- locks -------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock a device node and its ancestors against eviction. Returns the evictable delta.

        A node whose device copy a failed load dropped while it was locked (see locks.py) can
        still be locked through a lock taken on it before: the new lock goes where those went.
        """
        if not self.tree.in_tree(node) or node.device_pages is None:
            if node.parent is None and node.key == b"":
                return 0  # a root: nothing to protect
            target = self.moved_locks.target(node)  # (a node may have left the tree since)
            if target is None:
                raise ValueError(f"inc_lock_ref: {node!r} is not a device node of this cache")
            self.moved_locks.add(node, target)
            return self.inc_lock_ref(target)
        self.user_locks[node] += 1
        return self.tree.inc_lock(node)

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one inc_lock_ref on ``node``; raises if that node holds no such lock.
        A lock that moved (a failed load dropped the node's device copy) is released where it
        went."""
        target = self.moved_locks.take(node)  # first: the node may have left the tree since
        if target is not None:
            return self.dec_lock_ref(target)
        if node.parent is None:
            return 0
        if self.user_locks[node] <= 0:
            del self.user_locks[node]
            raise ValueError(f"dec_lock_ref: {node!r} holds no lock taken by inc_lock_ref")
        self.user_locks[node] -= 1
        if not self.user_locks[node]:
            del self.user_locks[node]
        delta = self.tree.dec_lock(node)
        self.tiering.push_device(node)
        return delta

    def lock_count(self, node: TreeNode) -> int:
        """inc_lock_ref calls on ``node`` not yet undone (moved ones included)."""
        return self.user_locks.get(node, 0) + self.moved_locks.count(node)

    # ---- insert ------------------------------------------------------------------------------
    def insert(
        self, token_ids: TokenIds, device_indices: object, namespace: Namespace = None
    ) -> int:
        """Cache ``token_ids`` whose KV sits in ``device_indices``; returns how many leading
        tokens were already cached (on either tier).

        Takes ownership of every caller-owned slot passed: new pages join the tree, pages
        duplicating cached tokens and the unaligned tail page are freed. Slots that already are
        the tree's own (from a match) are left as they are. The caller never frees after insert.
        Raises (and changes no ownership) for mismatched lengths or slots it does not own.
        """
        tokens = as_tokens(token_ids)
        slots = as_slots(device_indices)
        if len(slots) != len(tokens):
            raise ValueError(f"insert: {len(tokens)} token ids but {len(slots)} device indices")
        self.counters.insert_calls += 1
        return self.inserter.insert(tokens, slots, namespace)

    def _after_insert(self, path: list[TreeNode], leaf: TreeNode | None) -> None:
        """What follows an insert: a backup of the nodes whose hits call for one, or, with no
        host tier, the third tier under the only pool takes the new leaf."""
        if self.host_alloc is not None:
            self.book.backup_hot(path + [leaf] if leaf else path)
        elif self._l3 is not None and leaf is not None:
            self._l3.after_backup([leaf])

    # ---- maintenance -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        dev, host, ps = self.device_alloc, self.host_alloc, self.page_size
        return CacheStats(
            page_size=ps,
            device_capacity_tokens=dev.capacity_pages * ps,
            device_free_tokens=dev.free_pages * ps,
            device_cached_tokens=dev.count(PageState.TREE) * ps,
            device_owned_tokens=dev.count(PageState.OWNED) * ps,
            device_protected_tokens=self.tree.protected_tokens,
            device_evictable_tokens=self.tree.evictable_tokens,
            host_capacity_tokens=host.capacity_pages * ps if host else 0,
            host_free_tokens=host.free_pages * ps if host else 0,
            host_cached_tokens=host.count(PageState.TREE) * ps if host else 0,
            inflight_transfers=len(self.book.records),
            tree_nodes=self.tree.num_nodes,
            **vars(self.counters),
        )

    def attach_l3(self, tier: L3Tier) -> None:
        """Put a third tier under the host pool (made with this cache: ``L3Tier(cache, ...)``)."""
        if tier.cache is not self:
            raise ValueError("attach_l3: the tier was made for another cache")
        self.l3 = tier
        if self.events is not None:
            tier.announce(self.events)

    @property
    def l3(self) -> L3Tier | None:
        """The store under the host tier (attach_l3), or None."""
        return self._l3

    @l3.setter
    def l3(self, tier: L3Tier | None) -> None:
        self._l3 = self.tiering.l3 = self.book.l3 = tier

    def attach_events(self, events: TierEvents) -> None:
        """Report tier changes from now on (take them with ``events.take()``). Pages already
        cached are announced at the next take()."""
        if events.page_size != self.page_size:
            raise ValueError("attach_events: made for another page size")
        self.events = events
        self.tree.on_change = events.touch
        if self.l3 is not None:
            self.l3.announce(events)
        for node in self.tree.iter_nodes():
            events.touch(node)

    def check_integrity(self) -> None:
        """Raise IntegrityError if any invariant is broken (see integrity.py). Mutates nothing."""
        check_cache_integrity(self)

    def close(self) -> None:
        """Wait for in-flight copies, stop the transfer engine and release the pools."""
        if self.l3 is not None:  # before the pools: its IO thread reads and writes host pages
            if self.engine is not None:  # (and after the backups: the stop writes what they
                self.book.settle()  # copied, never pages a copy still fills)
            self.l3.close()
            self.l3 = None
        if self.engine is not None:
            self.book.settle()
            self.engine.close()
            assert self.host_pool is not None  # (made with the engine)
            self.host_pool.close()
        self.device_pool.close()

    # ---- the parts' operations as the cache's (the daemon, scripts) ----------------------
    @property
    def records(self) -> dict[Ticket, TransferRecord]:
        """Copies submitted and not acknowledged, by ticket (TransferRecord)."""
        return self.book.records

    @property
    def transfer_seconds(self) -> dict:
        return self.book.transfer_seconds

    @property
    def transfer_bytes(self) -> dict:
        return self.book.transfer_bytes

    def evict(self, num_tokens: int, to_l3: bool = True) -> EvictResult:
        """Evict at least ``num_tokens`` device tokens (Tiering.evict)."""
        return self.tiering.evict(num_tokens, to_l3)

    def evict_host(self, num_tokens: int, to_l3: bool = True) -> int:
        """Remove host-only leaves for ``num_tokens`` host tokens (Tiering.evict_host)."""
        return self.tiering.evict_host(num_tokens, to_l3)

    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> torch.Tensor | None:
        """Start loading the host-only chain that ends at ``node`` (TransferBook.load_back)."""
        return self.book.load_back(node, mem_quota)

    def load_ticket(self, node: TreeNode) -> Ticket | None:
        return self.book.load_ticket(node)

    def wait_load(self, node: TreeNode, timeout: float | None = None) -> bool:
        return self.book.wait_load(node, timeout)

    def layer_handles(self, ticket: Ticket) -> list[bytes] | None:
        """The CUDA IPC event handles of a load in flight, one per layer (None on the CPU)."""
        return None if self.engine is None else self.engine.layer_handles(ticket)

    def poll(self) -> int:
        """Process every ack the transfer engine has; returns how many."""
        return self.book.poll()

    def settle(self) -> bool:
        """Mutates: waits for every copy in flight and processes the acks; False when none."""
        return self.book.settle()

    def share_progress(self, progress: LayerProgress) -> bool:
        """Publish each load's finished layers in ``progress`` (a table engines read) from now
        on; False, changing nothing, without a host tier (there are no loads)."""
        if self.engine is None:
            return False
        self.engine.progress = progress
        return True

    # ---- what a caller may ask of the pools and the tree (reads only) ---------------------
    @property
    def device_capacity_pages(self) -> int:
        return self.device_alloc.capacity_pages

    @property
    def host_capacity_pages(self) -> int:
        """0 without a host tier."""
        return 0 if self.host_alloc is None else self.host_alloc.capacity_pages

    def page_states(self, pages: np.ndarray) -> np.ndarray:
        """Each device page's PageState (a copy): OWNED is a caller's, TREE the tree's.
        ``pages`` must be in range (``check_slots``)."""
        return self.device_alloc.state[pages]

    def count_pages(self, state: PageState, tier: str = "device") -> int:
        """How many pages of the ``device`` or ``host`` pool are in ``state`` (0: no host)."""
        alloc = self.device_alloc if tier == "device" else self.host_alloc
        return 0 if alloc is None else alloc.count(state)

    def check_slots(self, slots: np.ndarray) -> None:
        """Raise InvalidIndicesError unless every slot lies in the device pool."""
        self.device_alloc.check_slot_range(slots)

    def slots_of_pages(self, pages: np.ndarray) -> np.ndarray:
        """The device slots of ``pages``, in order (``page_size`` per page)."""
        return self.device_alloc.slots_of_pages(pages)

    def extend_pages_needed(self, prefix_lens: np.ndarray, seq_lens: np.ndarray) -> int:
        """Fresh device pages ``alloc_extend(prefix_lens, seq_lens, ...)`` would take."""
        return self.device_alloc.extend_pages_needed(prefix_lens, seq_lens)

    def nodes(self) -> Iterator[TreeNode]:
        """Every node of every namespace (roots left out), parents before children."""
        return self.tree.iter_nodes()

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    def holds(self, node: TreeNode) -> bool:
        """Whether ``node`` is still in the tree (evicted nodes are not)."""
        return self.tree.in_tree(node)

    def __enter__(self) -> HiRadixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
