"""Per-session limits, and what an OUT_OF_MEMORY reply says holds the memory.

One engine must not be able to starve the others: a session may own at most a fraction of the
device pool (pages allocated and not yet inserted or freed), hold a bounded number of locks and
have a bounded number of loads in flight. Going past a limit is ``QUOTA_EXCEEDED`` and changes
nothing. Pure bookkeeping over the session and the cache; control thread only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.protocol import ErrorCode, ProtocolError

if TYPE_CHECKING:
    from hicache.cache import HiRadixCache
    from hicache.daemon.sessions import Session

DEFAULT_OWNED_FRACTION = 0.75
DEFAULT_MAX_LOCKS = 65536
DEFAULT_MAX_LOADS = 256


@dataclass(frozen=True)
class SessionLimits:
    max_owned_pages: int  # device pages one session may own at once
    max_locks: int  # locks one session may hold at once
    max_loads: int  # load-backs of one session in flight at once

    @classmethod
    def for_pool(
        cls,
        device_pages: int,
        owned_fraction: float = DEFAULT_OWNED_FRACTION,
        max_locks: int = DEFAULT_MAX_LOCKS,
        max_loads: int = DEFAULT_MAX_LOADS,
    ) -> SessionLimits:
        if not 0 < owned_fraction <= 1:
            raise ValueError(f"session_owned_fraction: must be in (0, 1], got {owned_fraction}")
        if max_locks < 1 or max_loads < 1:
            raise ValueError("session_max_locks and session_max_loads: must be >= 1")
        return cls(max(1, int(device_pages * owned_fraction)), max_locks, max_loads)

    def check_owned(self, session: Session, new_pages: int) -> None:
        if len(session.owned) + new_pages > self.max_owned_pages:
            raise ProtocolError(
                ErrorCode.QUOTA_EXCEEDED,
                f"session {session.id} would own {len(session.owned) + new_pages} device pages; "
                f"a session may own {self.max_owned_pages} (insert or free some first)",
            )

    def check_locks(self, session: Session, new_locks: int) -> None:
        if len(session.locks) + new_locks > self.max_locks:
            raise ProtocolError(
                ErrorCode.QUOTA_EXCEEDED,
                f"session {session.id} would hold {len(session.locks) + new_locks} locks; "
                f"a session may hold {self.max_locks} (release some first)",
            )

    def check_loads(self, session: Session, in_flight: int) -> None:
        if in_flight >= self.max_loads:
            raise ProtocolError(
                ErrorCode.QUOTA_EXCEEDED,
                f"session {session.id} has {in_flight} loads in flight; "
                f"a session may have {self.max_loads} (wait for some first)",
            )


def out_of_memory(cache: HiRadixCache, holders: Iterable[Session], pages: int) -> ProtocolError:
    """OUT_OF_MEMORY naming what holds the device pool: free, owned (by whom), locked."""
    ps = cache.page_size
    stats = cache.stats()
    owners = sorted(((len(s.owned), s) for s in holders if s.owned), key=lambda x: -x[0])
    top = ", ".join(
        f"session {s.id} ({s.client}{', lapsed' if s.release_at else ''}) {n * ps}"
        for n, s in owners[:3]
    )
    return ProtocolError(
        ErrorCode.OUT_OF_MEMORY,
        f"the device pool cannot give {pages * ps} tokens: {stats.device_free_tokens} free, "
        f"{stats.device_owned_tokens} owned by sessions ({top or 'none'}), "
        f"{stats.device_protected_tokens} locked in the tree, "
        f"{stats.device_evictable_tokens} evictable, {stats.inflight_transfers} copies in flight"
        + _held_by_writes(cache),
    )


def _held_by_writes(cache: HiRadixCache) -> str:
    """What pages of the device pool writes to a third tier under it hold (freed as each
    write ends)."""
    l3 = cache.l3
    if l3 is None or cache.host_alloc is not None:
        return ""
    held = sum(map(len, l3.held_pages())) * cache.page_size
    return f", {held} held by writes to the third tier (free when they end)" if held else ""
