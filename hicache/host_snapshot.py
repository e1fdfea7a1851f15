"""Host snapshots: the host tier's part of the tree, written down so that the next daemon on the
same host pool adopts it instead of starting cold.

``take(cache)`` lists every tree node whose host copy is readable (not being written by a
backup), parents first: its namespace, the token ids from the root to its end, its host page
ids and the checksum of each page (page_sums.py; the maintained ones under verify_pages, else
computed now). ``restore(cache, snapshot)`` runs on a fresh cache over the same host memory:
each node whose pages still have their checksums, and whose parent was adopted (or is a
root), becomes a host-only node again; the rest is dropped (a page reused after a periodic
snapshot, a node whose parent went). Nothing is trusted that is not verified: at worst the
cache starts colder than it could.

``take`` does it all at once. A daemon without maintained checksums splits it so that reading
a large pool's bytes does not stall requests: ``list_host`` on the cache thread, with the host
allocator watching frees; ``sum_pages`` on another thread; ``seal`` back on the cache thread
leaves out every node one of whose pages was freed meanwhile (its bytes may be another
prefix's by now, and the checksum would vouch for them).

The snapshot is plain data (msgpack-able); where it is kept and which memory it goes with is
the daemon's business (daemon/snapshot.py). ``restore`` runs on the cache's thread.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.allocator import PageState
from hicache.node import IO_BACKUP
from hicache.page_sums import PageSums

if TYPE_CHECKING:
    from hicache.cache import HiRadixCache
    from hicache.config import HiCacheConfig

VERSION = 1
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


def identity(config: HiCacheConfig) -> dict[str, Any]:
    """The facts a snapshot must share with the cache that adopts it (its host pool's shape)."""
    names = {f.name for f in fields(config)}
    out = {k: _plain(getattr(config, k)) for k in SHAPE_FIELDS if k in names}
    pages = config.host_capacity_tokens // config.page_size
    out["host_pages"] = pages
    out["host_bytes"] = pages * config.page_size * config.token_bytes
    return out


def _plain(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


@dataclass
class Listing:
    """The host tier's nodes at one moment, waiting for their pages' checksums."""

    nodes: list[tuple[str, bytes, np.ndarray]]  # (namespace, tokens from the root, host pages)
    pages: np.ndarray  # every listed page, in node order (int64)
    sums: np.ndarray | None = None  # their checksums, once computed (uint64)


def list_host(cache: HiRadixCache) -> Listing:
    """The nodes whose host copy is readable (not being written by a backup), parents first.
    Cache thread; reads only."""
    if cache.host_pool is None:
        raise ValueError("snapshot: the cache has no host tier")
    nodes, pb = [], cache.tree.page_bytes
    for node in cache.tree.iter_nodes():  # parents before children
        if node.host_pages is None or node.io is IO_BACKUP:
            continue
        key, up = [node.key], node.parent
        while up.parent is not None:
            key.append(up.key)
            up = up.parent
        full = b"".join(reversed(key))
        assert len(full) % pb == 0
        pages = np.asarray(node.host_pages, dtype=np.int64)
        nodes.append((node.namespace, full, pages))
    every = np.concatenate([p for _, _, p in nodes]) if nodes else np.zeros(0, np.int64)
    return Listing(nodes, every)


def sum_pages(cache: HiRadixCache, listing: Listing, computer: PageSums | None = None) -> None:
    """Fill ``listing.sums``: the maintained checksums under verify_pages (cache thread), else
    computed from the pages' bytes now by ``computer`` (a PageSums over the host pool; any
    thread: it only reads the pool; a page freed and rewritten meanwhile gets a wrong sum,
    which ``seal`` leaves out)."""
    sums = cache.engine.sums if cache.engine is not None else None
    if sums is not None:
        listing.sums = sums.sums[listing.pages]
        return
    computer = computer or PageSums(cache.host_pool.page_view)
    listing.sums = computer.compute(listing.pages)


def seal(cache: HiRadixCache, listing: Listing, freed: np.ndarray | None = None) -> dict[str, Any]:
    """The snapshot of ``listing`` (plain data). ``freed``: pages freed since the listing was
    made (the allocator's watch); a node with such a page is left out, so a checksum never
    vouches for bytes that another prefix wrote. Cache thread."""
    assert listing.sums is not None, "sum_pages first"
    out, at = [], 0
    for namespace, full, pages in listing.nodes:
        page_sums = listing.sums[at : at + len(pages)]
        at += len(pages)
        if freed is not None and freed[pages].any():
            continue  # (what hangs below goes at restore: its parent is missing)
        out.append([namespace, full, pages.tobytes(), page_sums.astype("<u8").tobytes()])
    return {"version": VERSION, "identity": identity(cache.config), "nodes": out}


def take(cache: HiRadixCache) -> dict[str, Any]:
    """The host tier's nodes (parents first) with their pages' checksums, all at once on the
    cache thread. Reads the pages' bytes unless verify_pages keeps the checksums already."""
    listing = list_host(cache)
    sum_pages(cache, listing)
    return seal(cache, listing)


def restore(cache: HiRadixCache, snapshot: dict[str, Any]) -> tuple[int, int]:
    """Adopt what ``snapshot`` names and still verifies, on a cache with an empty host tier over
    the same memory. Returns (tokens adopted, tokens dropped). ValueError, changing nothing,
    for a snapshot of another shape or version."""
    if snapshot.get("version") != VERSION:
        raise ValueError(f"snapshot version {snapshot.get('version')!r}, expected {VERSION}")
    if snapshot.get("identity") != identity(cache.config):
        raise ValueError(
            f"snapshot of another host pool: {snapshot.get('identity')} != {identity(cache.config)}"
        )
    if cache.host_alloc.free_pages != cache.host_alloc.capacity_pages:
        raise ValueError("restore: the host tier is not empty")
    tree, alloc, pb = cache.tree, cache.host_alloc, cache.tree.page_bytes
    sums = cache.engine.sums if cache.engine is not None else None
    check = sums or PageSums(cache.host_pool.page_view)
    adopted = dropped = 0
    for namespace, full, raw_pages, raw_sums in snapshot["nodes"]:
        pages = np.frombuffer(raw_pages, dtype=np.int64).copy()
        want = np.frombuffer(raw_sums, dtype="<u8").astype(np.uint64)
        tokens = len(pages) * cache.page_size
        start = len(full) - len(pages) * pb
        ok = (
            start >= 0
            and len(want) == len(pages)
            and len(pages) > 0
            and int(pages.min()) >= 0
            and int(pages.max()) < alloc.num_pages
            and not alloc.has_duplicates(pages)
            and (alloc.state[pages] == PageState.FREE).all()
        )
        try:
            root = tree.root(namespace, create=True) if ok else None
        except ValueError:  # not a namespace this cache would make
            root, ok = None, False
        if ok:
            path, covered = tree.walk(root, full[:start])
            parent = path[-1] if path else root
            ok = covered == start and (not path or parent.host_pages is not None)
            ok = ok and full[start : start + pb] not in parent.children
            ok = ok and bool((check.compute(pages) == want).all())
        if not ok:
            dropped += tokens
            if root is not None and not root.children:
                cache._drop_empty_root(root)
            continue
        alloc.take_pages(pages, PageState.TREE)
        leaf = tree.add_host_leaf(parent, full[start:], pages)
        if sums is not None:
            sums.sums[pages] = want
        cache._push_host(leaf)
        cache._push_host(leaf.parent)
        adopted += tokens
    return adopted, dropped
