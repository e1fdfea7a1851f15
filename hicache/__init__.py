"""hicache: a hierarchical GPU/CPU KV-cache tier (HiRadixCache) for LLM inference engines.

The core is pure: no sockets, no CLI, no metrics sinks. See README.md for the public API.
Names are imported on first use, so that light users (the ``hicache`` CLI, the wire schema)
never pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache._checkout import defer

defer(__file__)  # (a checkout's folder stands aside for the installed hicache: _checkout.py)

from hicache.lazy import lazy_exports  # noqa: E402

_EXPORTS = {
    "HiRadixCache": "hicache.cache",
    "EvictionPolicyName": "hicache.config",
    "HiCacheConfig": "hicache.config",
    "HostLayout": "hicache.config",
    "KVFormat": "hicache.config",
    "TransferBackend": "hicache.config",
    "WritePolicyName": "hicache.config",
    "DoubleFreeError": "hicache.errors",
    "HiCacheError": "hicache.errors",
    "InsufficientMemoryError": "hicache.errors",
    "IntegrityError": "hicache.errors",
    "InvalidIndicesError": "hicache.errors",
    "IOState": "hicache.tree.node",
    "TreeNode": "hicache.tree.node",
    "CacheStats": "hicache.observe",
    "EvictResult": "hicache.types",
    "MatchResult": "hicache.types",
}
__all__ = [
    "CacheStats",
    "DoubleFreeError",
    "EvictResult",
    "EvictionPolicyName",
    "HiCacheConfig",
    "HiCacheError",
    "HiRadixCache",
    "HostLayout",
    "IOState",
    "InsufficientMemoryError",
    "IntegrityError",
    "InvalidIndicesError",
    "KVFormat",
    "MatchResult",
    "TransferBackend",
    "TreeNode",
    "WritePolicyName",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from hicache.cache import HiRadixCache
    from hicache.config import (
        EvictionPolicyName,
        HiCacheConfig,
        HostLayout,
        KVFormat,
        TransferBackend,
        WritePolicyName,
    )
    from hicache.errors import (
        DoubleFreeError,
        HiCacheError,
        InsufficientMemoryError,
        IntegrityError,
        InvalidIndicesError,
    )
    from hicache.observe import CacheStats
    from hicache.tree import IOState, TreeNode
    from hicache.types import EvictResult, MatchResult


__getattr__ = lazy_exports("hicache", _EXPORTS, globals())
