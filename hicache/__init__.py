"""hicache: a hierarchical GPU/CPU KV-cache tier (HiRadixCache) for LLM inference engines.

The core is pure: no sockets, no CLI, no metrics sinks. See README.md for the public API.
"""

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
from hicache.node import IOState, TreeNode
from hicache.stats import CacheStats
from hicache.types import EvictResult, MatchResult

__all__ = [
    "CacheStats",
    "DoubleFreeError",
    "EvictResult",
    "EvictionPolicyName",
    "HiCacheConfig",
    "HiCacheError",
    "HiRadixCache",
    "HostLayout",
    "TransferBackend",
    "IOState",
    "InsufficientMemoryError",
    "IntegrityError",
    "InvalidIndicesError",
    "KVFormat",
    "MatchResult",
    "TreeNode",
    "WritePolicyName",
]
__version__ = "0.1.0"
