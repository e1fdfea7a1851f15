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

from hicache.daemon.sessions.table import MAX_SESSIONS_PER_PEER, USER_SHARE, holder
from hicache.daemon.transport import IN_ALL, PER_CONNECTION
from hicache.protocol import MAX_FRAME_BYTES, ErrorCode, ProtocolError

if TYPE_CHECKING:
    from hicache.cache import HiRadixCache
    from hicache.daemon.sessions.table import Session

DEFAULT_OWNED_FRACTION = 0.75
DEFAULT_MAX_LOCKS = 65536
DEFAULT_MAX_LOADS = 256
SNDHWM = 64  # replies queued per connection before they are dropped (a client has a few)
LOCK_BYTES = 200  # what one held lock costs the daemon (its record and its id; measured ~190)
TOTAL_LOCKS_PER_PAGE = 64  # locks of every session at once, per device page (from 65,536 ...)
MAX_TOTAL_LOCKS = 1 << 20  # (... to 1M: 200 MiB)
SHARES_OF_ALL_LOCKS = 4  # a session holds at most this share (1/4) of all sessions' locks


@dataclass(frozen=True)
class SessionLimits:
    max_owned_pages: int  # device pages one session may own at once
    max_locks: int  # locks one session may hold at once
    max_loads: int  # load-backs of one session in flight at once
    max_total_locks: int = MAX_TOTAL_LOCKS  # locks of every session at once
    pool: str = "device"  # what operators call the pool (host: a daemon for engine tiers)

    @classmethod
    def for_pool(
        cls,
        device_pages: int,
        owned_fraction: float = DEFAULT_OWNED_FRACTION,
        max_locks: int = DEFAULT_MAX_LOCKS,
        max_loads: int = DEFAULT_MAX_LOADS,
        pool: str = "device",
    ) -> SessionLimits:
        if not 0 < owned_fraction <= 1:
            raise ValueError(f"session_owned_fraction: must be in (0, 1], got {owned_fraction}")
        if max_locks < 1 or max_loads < 1:
            raise ValueError("session_max_locks and session_max_loads: must be >= 1")
        total = min(MAX_TOTAL_LOCKS, max(65536, TOTAL_LOCKS_PER_PAGE * device_pages))
        # one session takes at most a quarter of every session's locks: one client alone
        # cannot leave the others none
        max_locks = min(max_locks, max(1, total // SHARES_OF_ALL_LOCKS))
        owned = max(1, int(device_pages * owned_fraction))
        return cls(owned, max_locks, max_loads, total, pool)

    def describe(self, max_sessions: int) -> str:
        """What these limits let every client together hold in the daemon's memory at most
        (said at start): locks, and replies queued for connections that do not read."""
        locks = self.max_total_locks * LOCK_BYTES
        return (
            f"limits: {max_sessions} sessions ({MAX_SESSIONS_PER_PEER} per connection, "
            f"{max(MAX_SESSIONS_PER_PEER, max_sessions // USER_SHARE)} per CurveZMQ key, ipc "
            f"process or local user on tcp); {self.max_locks} locks each, {self.max_total_locks}"
            f" in all (~{locks / 2**20:.0f} MiB); {self.max_owned_pages} {self.pool} pages owned"
            f" or pinned each; {SNDHWM} replies queued per connection; frames of at most "
            f"{MAX_FRAME_BYTES / 2**20:.0f} MiB; on tcp, {PER_CONNECTION / 2**20:.0f} MiB sent"
            f" and not read yet per connection, {IN_ALL / 2**20:.0f} MiB in all"
        )

    def check_owned(self, session: Session, new_pages: int) -> None:
        """Pages it owns and pages its locks pinned (see check_pinned) share one bound; so do
        those of every session of one CurveZMQ key (``fellows``), or one client could hold
        the whole pool a share per session."""
        held = len(session.owned) + session.pinned_pages
        if held + new_pages > self.max_owned_pages:
            raise ProtocolError(
                ErrorCode.QUOTA_EXCEEDED,
                f"session {session.id} would hold {held + new_pages} {self.pool} pages "
                f"({len(session.owned)} owned, {session.pinned_pages} pinned by its locks, "
                f"{new_pages} new); a session may hold {self.max_owned_pages} (insert, free or "
                "release some first)",
            )
        if len(session.fellows) > 1:
            held = sum(len(s.owned) + s.pinned_pages for s in session.fellows)
            if held + new_pages > self.max_owned_pages:
                who = holder(session.user)
                raise ProtocolError(
                    ErrorCode.QUOTA_EXCEEDED,
                    f"the {len(session.fellows)} sessions of this {who} would hold "
                    f"{held + new_pages} {self.pool} pages (owned or pinned by their locks); "
                    f"one {who} may hold {self.max_owned_pages}, as one session may (insert, "
                    "free or release some first)",
                )

    def check_pinned(self, session: Session, new_pages: int) -> None:
        """A lock that makes ``new_pages`` device pages unevictable (no other lock held them):
        charged to the session like owned pages, or one engine could pin the whole pool by
        inserting and locking what it allocated, a share at a time."""
        if new_pages:
            self.check_owned(session, new_pages)

    def check_locks(self, session: Session, new_locks: int) -> None:
        if session.tally[0] + new_locks > self.max_total_locks:
            raise ProtocolError(
                ErrorCode.QUOTA_EXCEEDED,
                f"the daemon holds {session.tally[0]} locks for all sessions; at most "
                f"{self.max_total_locks} at once (release some first)",
            )
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
    if l3 is None or cache.config.host_enabled:
        return ""
    held = sum(map(len, l3.held_pages())) * cache.page_size
    return f", {held} held by writes to the third tier (free when they end)" if held else ""
