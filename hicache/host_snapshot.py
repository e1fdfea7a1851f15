"""Host snapshots: the host tier's part of the tree, written down so that the next daemon on the
same host pool adopts it instead of starting cold.

A snapshot lists every tree node whose host copy is readable (not being written by a backup)
and whose parent is listed too, parents first: the index of its parent in the list (-1 under a
namespace's root), its namespace, its own key (token ids as int32 bytes), its host page ids
and the checksum of each page (page_sums.py; the maintained ones under verify_pages, else
computed). Its size is linear in the pages it names. ``restore(cache, snapshot)`` runs on a
fresh cache over the same host memory: each entry whose pages still have their checksums,
and whose parent was adopted (or is a root), becomes a host-only node again; the rest is
dropped (a page reused after a periodic snapshot, a node whose parent went, an entry that is
not well formed). Nothing is trusted that is not verified: at worst the cache starts colder
than it could. ``restore`` returns the snapshot of what it adopted too, so that the daemon
can write it down at once (a crash right after an adopting start keeps the tier).

``take`` does it all at once. A daemon without maintained checksums splits it so that reading
a large pool's bytes does not stall requests: ``list_host`` on the cache thread, with the host
allocator watching frees; ``sum_pages`` on another thread; ``seal`` back on the cache thread
leaves out every node one of whose pages was freed meanwhile (its bytes may be another
prefix's by now, and the checksum would vouch for them), and what hangs below it.

``identity`` names what shapes the pool's bytes, and ``model`` what they mean where the
daemon knows it (the third tier's model and shard): a snapshot is adopted only under equal
identities. The snapshot is plain data (msgpack-able); where it is kept and which memory it
goes with is the daemon's business (daemon/keep/snapshot.py). All but ``sum_pages`` run on the
cache's thread.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hicache.memory import PageState, PageSums
from hicache.tree import IO_BACKUP

if TYPE_CHECKING:
    from hicache.cache import HiRadixCache
    from hicache.config import HiCacheConfig
    from hicache.tree import TreeNode

VERSION = 2  # 2: entries name their parent's index and hold only their own key
# what shapes the host pool's bytes: a snapshot is adopted only under equal values
SHAPE_FIELDS = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "dtype",
    "page_size",
    "host_layout",
)


def identity(config: HiCacheConfig, model: str | None = None) -> dict[str, Any]:
    """The facts a snapshot must share with the cache that adopts it: its host pool's shape,
    and ``model`` (what the KV means, where the daemon knows it)."""
    names = {f.name for f in fields(config)}
    out = {k: _plain(getattr(config, k)) for k in SHAPE_FIELDS if k in names}
    pages = config.host_capacity_tokens // config.page_size
    out["host_pages"] = pages
    out["host_bytes"] = pages * config.page_size * config.token_bytes
    out["model"] = model
    return out


def max_bytes(config: HiCacheConfig) -> int:
    """The most bytes a snapshot of ``config``'s host pool can take (each page is named once,
    with its key, id, checksum and at most one entry's overhead): a larger file is not ours."""
    pages = config.host_capacity_tokens // config.page_size
    return pages * (4 * config.page_size + 8 + 8 + 64) + (1 << 16)


def _plain(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


@dataclass
class Listing:
    """The host tier's nodes at one moment, waiting for their pages' checksums."""

    # (parent's index or -1, namespace, the node's own key, its host pages), parents first
    nodes: list[tuple[int, Any, bytes, np.ndarray]]
    pages: np.ndarray  # every listed page, in node order (int64)
    sums: np.ndarray | None = None  # their checksums, once computed (uint64)


def watch_frees(cache: HiRadixCache) -> None:
    """Mutates the host allocator: it marks every page freed from now on (anew), so that a
    listing made next can be sealed against them. Cache thread."""
    if cache.host_alloc is None:
        raise ValueError("snapshot: the cache has no host tier")
    cache.host_alloc.watch_frees()


def unwatch_frees(cache: HiRadixCache) -> np.ndarray | None:
    """Mutates the host allocator: it stops marking frees. Returns the marks (a bool per
    host page; None when nothing watched). Cache thread."""
    alloc = cache.host_alloc
    if alloc is None:
        return None
    freed = alloc.freed
    alloc.unwatch_frees()
    return freed


def list_host(cache: HiRadixCache) -> Listing:
    """The nodes whose host copy is readable (not being written by a backup) and whose parent
    is listed (or a root), parents first. Cache thread; reads only."""
    if cache.host_pool is None:
        raise ValueError("snapshot: the cache has no host tier")
    nodes: list[tuple[int, Any, bytes, np.ndarray]] = []
    index: dict[int, int] = {}  # id(node) -> its index in ``nodes``
    for node in cache.tree.iter_nodes():  # parents before children
        if node.host_pages is None or node.io is IO_BACKUP:
            continue
        up = node.parent
        assert up is not None  # (iter_nodes: no roots)
        parent = -1 if up.parent is None else index.get(id(up))
        if parent is None:  # its parent is not listed: nothing to hang it on
            continue
        index[id(node)] = len(nodes)
        pages = np.asarray(node.host_pages, dtype=np.int64)
        nodes.append((parent, node.namespace, node.key, pages))
    every = np.concatenate([p for *_, p in nodes]) if nodes else np.zeros(0, np.int64)
    return Listing(nodes, every)


def summer(cache: HiRadixCache) -> PageSums:
    """A PageSums over ``cache``'s host pool, for ``sum_pages`` on another thread."""
    if cache.host_pool is None:
        raise ValueError("snapshot: the cache has no host tier")
    return PageSums(cache.host_pool.page_view)


def sum_pages(cache: HiRadixCache, listing: Listing, computer: PageSums | None = None) -> None:
    """Fill ``listing.sums``: the maintained checksums under verify_pages (cache thread), else
    computed from the pages' bytes now by ``computer`` (a PageSums over the host pool; any
    thread: it only reads the pool; a page freed and rewritten meanwhile gets a wrong sum,
    which ``seal`` leaves out)."""
    sums = cache.engine.sums if cache.engine is not None else None
    if sums is not None:
        listing.sums = sums.sums[listing.pages]
        return
    if computer is None:  # (a PageSums is never false)
        computer = summer(cache)
    listing.sums = computer.compute(listing.pages)


def seal(
    cache: HiRadixCache,
    listing: Listing,
    freed: np.ndarray | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """The snapshot of ``listing`` (plain data). ``freed``: pages freed since the listing was
    made (the allocator's watch); a node with such a page is left out, and what hangs below
    it, so a checksum never vouches for bytes that another prefix wrote. Cache thread."""
    assert listing.sums is not None, "sum_pages first"
    out: list[list[Any]] = []
    kept: list[int] = []  # kept[i]: listing entry i's index in ``out`` (or -1)
    at = 0
    for parent, namespace, key, pages in listing.nodes:
        page_sums = listing.sums[at : at + len(pages)]
        at += len(pages)
        up = -1 if parent < 0 else kept[parent]
        if (parent >= 0 and up < 0) or (freed is not None and freed[pages].any()):
            kept.append(-1)
            continue
        kept.append(len(out))
        out.append([up, namespace, key, pages.tobytes(), page_sums.astype("<u8").tobytes()])
    return snapshot_of(cache.config, out, model)


def snapshot_of(config: HiCacheConfig, entries: list, model: str | None = None) -> dict[str, Any]:
    return {"version": VERSION, "identity": identity(config, model), "nodes": entries}


def take(cache: HiRadixCache, model: str | None = None) -> dict[str, Any]:
    """The host tier's nodes (parents first) with their pages' checksums, all at once on the
    cache thread. Reads the pages' bytes unless verify_pages keeps the checksums already."""
    listing = list_host(cache)
    sum_pages(cache, listing)
    return seal(cache, listing, model=model)


class Restored(NamedTuple):
    adopted: int  # tokens adopted
    dropped: int  # tokens named but not adopted (changed, orphaned, not well formed)
    snapshot: dict[str, Any]  # the snapshot of what was adopted (the same checksums)


def restore(cache: HiRadixCache, snapshot: Any, model: str | None = None) -> Restored:
    """Adopt what ``snapshot`` names and still verifies, on a cache with an empty host tier over
    the same memory. ValueError, changing nothing, for a snapshot of another identity or
    version, or one that is not a snapshot at all; an entry that is not well formed is
    dropped with what hangs below it."""
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("nodes"), list):
        raise ValueError("not a host snapshot")
    if snapshot.get("version") != VERSION:
        raise ValueError(f"snapshot version {snapshot.get('version')!r}, expected {VERSION}")
    want = identity(cache.config, model)
    if snapshot.get("identity") != want:
        raise ValueError(f"snapshot of another host pool: {snapshot.get('identity')} != {want}")
    assert cache.host_alloc is not None and cache.host_pool is not None  # (a host tier's)
    if cache.host_alloc.free_pages != cache.host_alloc.capacity_pages:
        raise ValueError("restore: the host tier is not empty")
    sums = cache.engine.sums if cache.engine is not None else None
    check = sums or PageSums(cache.host_pool.page_view)
    adopted = dropped = 0
    made: list[TreeNode | None] = []  # entry i's node, or None when it was dropped
    kept: list[list] = []  # the entries adopted, their parents re-indexed
    where: dict[int, int] = {}  # id(node) -> its index in ``kept``
    for entry in snapshot["nodes"]:
        node, tokens = _adopt(cache, check, entry, made)
        made.append(node)
        if node is None:
            dropped += tokens
            continue
        adopted += tokens
        if sums is not None:
            sums.sums[node.host_pages] = np.frombuffer(entry[4], dtype="<u8")
        where[id(node)] = len(kept)
        up = node.parent
        assert up is not None  # (just hung under it)
        kept.append([-1 if up.parent is None else where[id(up)], *entry[1:]])
    for root in cache.tree.roots():  # a namespace whose entries all went leaves no root
        if not root.children:
            cache.tree.drop_if_empty(root)
    return Restored(adopted, dropped, snapshot_of(cache.config, kept, model))


def _adopt(
    cache: HiRadixCache, check: PageSums, entry: Any, made: list[TreeNode | None]
) -> tuple[TreeNode | None, int]:
    """One entry made a host-only leaf (returned), or None and the tokens it named."""
    tree, alloc, pb = cache.tree, cache.host_alloc, cache.tree.page_bytes
    assert alloc is not None  # (restore: a host tier)
    tokens = 0
    parent: TreeNode | None
    try:
        parent_at, namespace, key, raw_pages, raw_sums = entry
        pages = np.frombuffer(raw_pages, dtype=np.int64).copy()
        tokens = len(pages) * cache.page_size
        want = np.frombuffer(raw_sums, dtype="<u8").astype(np.uint64)
        if type(parent_at) is not int or not -1 <= parent_at < len(made):
            return None, tokens
        if not isinstance(key, bytes) or len(key) != len(pages) * pb or len(want) != len(pages):
            return None, tokens
        if parent_at < 0:
            parent = tree.root(namespace, create=True)  # ValueError: not a namespace of ours
        else:
            parent = made[parent_at]
            if parent is None or namespace != parent.namespace:
                return None, tokens
    except (TypeError, ValueError):  # not an entry at all
        return None, tokens
    ok = (
        len(pages) > 0
        and int(pages.min()) >= 0
        and int(pages.max()) < alloc.num_pages
        and not alloc.has_duplicates(pages)
        and (alloc.state[pages] == PageState.FREE).all()
        and key[:pb] not in parent.children
        and bool((check.compute(pages) == want).all())
    )
    if not ok:
        return None, tokens
    alloc.take_pages(pages, PageState.TREE)
    leaf = tree.add_host_leaf(parent, key, pages)
    cache.tiering.push_host(leaf)
    cache.tiering.push_host(leaf.parent)
    return leaf, tokens
