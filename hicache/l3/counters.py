"""The third tier's counters, and small helpers of tier.py (pure; no state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.tree import TreeNode

EWMA = 0.2  # weight of a new measurement in the bandwidth and latency averages


@dataclass
class L3Counters:
    """What the tier did (pages unless named otherwise)."""

    lookups: int = 0  # fetches started
    lookup_pages: int = 0  # pages asked about
    hit_pages: int = 0  # pages the store had
    read_pages: int = 0  # pages read and verified
    adopted_pages: int = 0  # pages that joined the tree (host-only, or leaves of the only pool)
    read_bytes: int = 0
    written_pages: int = 0  # pages put
    present_pages: int = 0  # pages the store had already (not put again)
    written_bytes: int = 0
    write_back_pages: int = 0  # pages eviction handed to a write (write_back)
    dropped_pages: int = 0  # writes dropped: queue full
    failed_write_pages: int = 0  # writes the store refused or could not take
    no_prefix_writes: int = 0  # writes not made: the store let their prefix go (made again)
    corrupt_pages: int = 0  # values that did not verify (never served)
    skipped_cost: int = 0  # fetches skipped: slower than recomputing
    skipped_breaker: int = 0  # fetches not started: the breaker is open
    skipped_room: int = 0  # fetches dropped: no free pages for them
    errors: int = 0  # jobs that failed as a whole (store down, breaker open)
    wait_timeouts: int = 0  # matches answered at their bound before the fetch ended


def ewma(old: float, new: float) -> float:
    return new if not old else (1 - EWMA) * old + EWMA * new


def keys_above(node: TreeNode) -> list[bytes]:
    """The keys of ``node``'s ancestors, root first."""
    keys = []
    up = node.parent
    while up is not None and up.parent is not None:
        keys.append(up.key)
        up = up.parent
    keys.reverse()
    return keys


def tokens_above(node: TreeNode) -> int:
    tokens, up = 0, node.parent
    while up is not None and up.parent is not None:
        tokens += up.num_tokens
        up = up.parent
    return tokens
