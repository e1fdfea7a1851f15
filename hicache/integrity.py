"""check_cache_integrity: every invariant of HiRadixCache, checked from scratch (it sees the
cache as a ``CacheView``: cache_view.py).

Linear in the tree size; meant for tests (after every step) and for debugging a live daemon.
It only reads. Each failure names the invariant, because it is always a bug in hicache.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from hicache.errors import IntegrityError
from hicache.memory import PagedAllocator, PageState
from hicache.observe import wanted
from hicache.transfers import Direction
from hicache.tree import IOState, TreeNode

if TYPE_CHECKING:
    from hicache.cache_view import CacheView


def _fail(msg: str) -> NoReturn:
    raise IntegrityError(msg)


def _check_node_shape(cache: CacheView, node: TreeNode) -> None:
    ps_bytes, ps = cache.tree.page_bytes, cache.page_size
    parent = node.parent
    assert parent is not None  # (tree.iter_nodes: no roots)
    if not node.key or len(node.key) % ps_bytes:
        _fail(f"{node}: key is empty or not whole pages")
    if parent.children.get(node.key[:ps_bytes]) is not node:
        _fail(f"{node}: not reachable from its parent under its first page")
    if node.namespace != parent.namespace:
        _fail(f"{node}: namespace differs from its parent's")
    if node.host_pages is not None and len(node.host_pages) * ps != node.num_tokens:
        _fail(f"{node}: host pages do not cover its key")
    if node.device_pages is not None:
        if not isinstance(node.device_pages, bytes) or len(node.device_pages) % 8:
            _fail(f"{node}: device pages are not int64 bytes")
        pages = len(node.device_pages) // 8
        if pages * ps != node.num_tokens:
            _fail(f"{node}: {pages} device pages for {node.num_tokens} tokens")
    if node.device_pages is None and node.host_pages is None:
        _fail(f"{node}: resident on neither tier")
    if node.device_pages is not None and parent.parent is not None and parent.device_pages is None:
        _fail(f"{node}: on the device below a host-only parent (device set not prefix-closed)")


def _check_node_state(cache: CacheView, node: TreeNode) -> None:
    if node.device_pages is None:  # host-only
        if node.lock_ref or node.host_ref or node.io is not IOState.NONE:
            _fail(f"{node}: host-only yet locked, protected or in flight")
        return
    if node.io is IOState.NONE:
        if node.transfer is not None or node.host_ref:
            _fail(f"{node}: no transfer, yet a record or host protection")
        return
    record = None if node.transfer is None else cache.records.get(node.transfer.ticket)
    if record is None or record is not node.transfer:
        _fail(f"{node}: io={node.io.name} without a live transfer record")
    if node not in record.nodes or node.host_pages is None:
        _fail(f"{node}: not listed by its record, or no host pages")
    want = Direction.BACKUP if node.io is IOState.BACKUP else Direction.LOAD
    if record.direction is not want:
        _fail(f"{node}: io={node.io.name} but record is {record.direction.name}")
    if node.io is IOState.LOAD and node.host_ref < 1:
        _fail(f"{node}: loading without host protection")


def _check_locks(cache: CacheView, nodes: list[TreeNode]) -> None:
    """lock_ref == locks held on the node or below (user locks plus transfer locks)."""
    direct: Counter[TreeNode] = Counter(cache.user_locks)
    protect: Counter[TreeNode] = Counter()
    for record in cache.records.values():
        direct.update(record.locked)
        if record.direction is Direction.LOAD:
            protect.update(record.nodes)
    expected: Counter[TreeNode] = Counter()
    for node in reversed(nodes):  # children first
        expected[node] += direct[node]
        if node.parent is not None:
            expected[node.parent] += expected[node]
    for node in nodes:
        if node.lock_ref != expected[node]:
            _fail(f"{node}: lock_ref {node.lock_ref} != {expected[node]} locks held")
        if node.host_ref != protect[node]:
            _fail(f"{node}: host_ref {node.host_ref} != {protect[node]} loads reading it")
        if node.lock_ref and node.device_pages is None:
            _fail(f"{node}: locked but not on the device")
    for node in direct:
        if not cache.tree.in_tree(node):
            _fail(f"{node}: a lock is held on a node outside the tree")
    for target, count in cache.moved_locks.by_target().items():
        if target.parent is not None and cache.user_locks[target] < count:
            _fail(f"{target}: holds {count} moved locks but {cache.user_locks[target]} locks")
        # (a moved lock on a root protects nothing: the root may even be gone since)


def _check_pages(alloc: PagedAllocator, arrays: list[np.ndarray], tier: str) -> None:
    alloc.check_integrity()
    pages = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    if len(np.unique(pages)) != len(pages):
        _fail(f"{tier}: a page is referenced by two tree nodes")
    if len(pages) and (alloc.state[pages] != PageState.TREE).any():
        _fail(f"{tier}: a tree page is not in the TREE state")
    if alloc.count(PageState.TREE) != len(pages):
        _fail(f"{tier}: TREE pages outside the tree")
    total = sum(alloc.count(s) for s in (PageState.FREE, PageState.OWNED, PageState.TREE))
    if total != alloc.capacity_pages or alloc.free_pages != alloc.count(PageState.FREE):
        _fail(f"{tier}: free + owned + cached != capacity")


def _check_heaps(cache: CacheView, nodes: list[TreeNode]) -> None:
    """Every eviction candidate has a heap entry at or below its current priority (lazy heaps
    whose entries are re-keyed when popped)."""
    for heap, is_candidate, tier in (
        (cache.device_heap, cache.tiering.device_candidate, "device"),
        (cache.host_heap, cache.tiering.host_candidate, "host"),
    ):
        if tier == "host" and cache.host_alloc is None:
            continue
        lowest: dict[int, object] = {}
        for prio, node_id, _ in heap._heap:
            if node_id not in lowest or prio < lowest[node_id]:
                lowest[node_id] = prio
        for node in nodes:
            if not is_candidate(node):
                continue
            if node.id not in lowest:
                _fail(f"{node}: {tier} eviction candidate missing from the heap")
            if lowest[node.id] > heap._priority(node):
                _fail(f"{node}: {tier} heap entry above the node's priority")


def check_cache_integrity(cache: CacheView) -> None:
    tree = cache.tree
    nodes = list(tree.iter_nodes())
    if len(nodes) != tree.num_nodes:
        _fail(f"tree holds {len(nodes)} nodes, counter says {tree.num_nodes}")
    for node in nodes:
        _check_node_shape(cache, node)
        _check_node_state(cache, node)
    _check_locks(cache, nodes)
    device = [n for n in nodes if n.device_pages is not None]
    evictable = sum(n.num_tokens for n in device if not n.lock_ref)
    protected = sum(n.num_tokens for n in device if n.lock_ref)
    if (evictable, protected) != (tree.evictable_tokens, tree.protected_tokens):
        _fail(
            f"evictable/protected counters {tree.evictable_tokens}/{tree.protected_tokens} "
            f"!= {evictable}/{protected} device tokens in the tree"
        )
    # pages the tree gave up while a write to the third tier still reads them
    held = cache.l3.held_pages() if cache.l3 is not None else []
    under_host = cache.host_alloc is not None
    on_device = [n.device_page_ids() for n in device]
    _check_pages(cache.device_alloc, on_device + ([] if under_host else held), "device")
    if cache.host_alloc is not None:  # (under_host)
        host = [n.host_pages for n in nodes if n.host_pages is not None]
        _check_pages(cache.host_alloc, host + held, "host")
    elif any(n.host_pages is not None for n in nodes):
        _fail("host pages in a cache without a host tier")
    for record in cache.records.values():
        for node in record.nodes:
            if node.transfer is not record or not tree.in_tree(node):
                _fail(f"record {record.ticket}: {node} left the tree or the record")
    _check_heaps(cache, nodes)
    if cache.l3 is not None:
        for message in cache.l3.check(nodes):
            _fail(message)
    elif any(n.l3 is not None and n.l3 is not True for n in nodes):
        _fail("a node names an L3 write, but there is no third tier")
    if cache.events is not None:
        _check_events(cache, nodes)
    if cache.engine is not None and cache.engine.sums is not None:
        _check_sums(cache, nodes)


def _check_sums(cache: CacheView, nodes: list[TreeNode]) -> None:
    """verify_pages: every host page the tree holds and no copy is writing still has the
    checksum it was sealed with (reads the pages: tests and debugging only)."""
    sealed = [
        n.host_pages for n in nodes if n.host_pages is not None and n.io is not IOState.BACKUP
    ]
    if sealed:
        pages = np.concatenate(sealed)
        now = cache.engine.sums.compute(pages)
        wrong = pages[now != cache.engine.sums.sums[pages]]
        if len(wrong):
            _fail(f"host pages {wrong[:8].tolist()} differ from their checksums")


def _check_events(cache: CacheView, nodes: list[TreeNode]) -> None:
    """What was announced is true of every node not touched since, and the announced page
    counts are what the nodes say (a consumer of every event holds exactly that)."""
    events = cache.events
    counts = {bit: 0 for bit in events.announced}
    for node in nodes:
        if node not in events.dirty and node.ev != wanted(node):
            _fail(f"{node}: announced tiers {node.ev} but holds {wanted(node)}, untouched")
        for bit in counts:
            if node.ev & bit:
                if (
                    node.ev_hashes is None
                    or len(node.ev_hashes) * cache.page_size != node.num_tokens
                ):
                    _fail(f"{node}: announced without a block hash per page")
                counts[bit] += len(node.ev_hashes)
    if not events.dirty and counts != events.announced:
        _fail(f"announced pages {events.announced} != {counts} announced in the tree")
