"""Observe: what the cache reports without changing it: its figures, KV events, the
capacity estimate and the page hashes it samples, tree views, latency histograms.

- ``stats.py``: ``CacheStats`` (a snapshot) and ``Counters`` (what the cache counts as it goes);
- ``figures.py``: every figure the daemon reports, named once (``FIGURES``: key, kind, unit,
  help, ``hicache info`` section, Prometheus family), read by STATS, /metrics, info and top;
- ``kv_events.py``: ``TierEvents``, vLLM-format KV events (stored, removed, cleared) per tier;
  ``storage_events.py``: what the disk holds (medium STORAGE), from the records (``Held``,
  ``Let``, ``Forgot``) its IO thread makes;
- ``capacity.py``: hit ratio against tier size (SHARDS sampling, ``ShardsEstimator``; the exact
  ``ExactCurve`` for tests), and a recommendation; ``lru_stack.py``: the LRU stack (reuse
  distances) both curves run on; ``page_hash.py``: the page hashes it samples;
- ``tree_view.py``: the tree's shape per namespace (``hicache tree``);
- ``histogram.py``: fixed-bucket histograms (request latency, copy sizes and times).

Names are imported on first use. Nothing outside this package imports its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.lazy import lazy_exports

_EXPORTS = {
    "CacheStats": "hicache.observe.stats",
    "DISK_FIGURES": "hicache.observe.figures",
    "FIGURES": "hicache.observe.figures",
    "Figure": "hicache.observe.figures",
    "L3_FIGURES": "hicache.observe.figures",
    "STRUCTURES": "hicache.observe.figures",
    "shown": "hicache.observe.figures",
    "Counters": "hicache.observe.stats",
    "AllBlocksCleared": "hicache.observe.kv_events",
    "BlockRemoved": "hicache.observe.kv_events",
    "BlockStored": "hicache.observe.kv_events",
    "Event": "hicache.observe.kv_events",
    "TierEvents": "hicache.observe.kv_events",
    "wanted": "hicache.observe.kv_events",
    "StorageChange": "hicache.observe.storage_events",
    "Forgot": "hicache.observe.storage_events",
    "Held": "hicache.observe.storage_events",
    "Let": "hicache.observe.storage_events",
    "held_pages": "hicache.observe.storage_events",
    "COLD": "hicache.observe.capacity",
    "FACTORS": "hicache.observe.capacity",
    "ShardsEstimator": "hicache.observe.capacity",
    "ExactCurve": "hicache.observe.capacity",
    "recommend": "hicache.observe.capacity",
    "TierPoint": "hicache.observe.capacity",
    "chain_seed": "hicache.observe.page_hash",
    "page_hashes": "hicache.observe.page_hash",
    "tree_shape": "hicache.observe.tree_view",
    "BYTES": "hicache.observe.histogram",
    "SECONDS": "hicache.observe.histogram",
    "Histogram": "hicache.observe.histogram",
}
__all__ = [
    "COLD",
    "DISK_FIGURES",
    "FIGURES",
    "Figure",
    "L3_FIGURES",
    "STRUCTURES",
    "shown",
    "AllBlocksCleared",
    "BYTES",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "Counters",
    "Event",
    "ExactCurve",
    "FACTORS",
    "Forgot",
    "Held",
    "Let",
    "StorageChange",
    "held_pages",
    "Histogram",
    "SECONDS",
    "ShardsEstimator",
    "TierEvents",
    "TierPoint",
    "chain_seed",
    "page_hashes",
    "recommend",
    "tree_shape",
    "wanted",
]
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:
    from hicache.observe.capacity import (
        COLD,
        FACTORS,
        ExactCurve,
        ShardsEstimator,
        TierPoint,
        recommend,
    )
    from hicache.observe.figures import (
        DISK_FIGURES,
        FIGURES,
        L3_FIGURES,
        STRUCTURES,
        Figure,
        shown,
    )
    from hicache.observe.histogram import BYTES, SECONDS, Histogram
    from hicache.observe.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        Event,
        TierEvents,
        wanted,
    )
    from hicache.observe.page_hash import chain_seed, page_hashes
    from hicache.observe.stats import CacheStats, Counters
    from hicache.observe.storage_events import Forgot, Held, Let, StorageChange, held_pages
    from hicache.observe.tree_view import tree_shape
