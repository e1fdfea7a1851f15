"""Sessions: who owns which device pages and holds which locks, and for how long.

Every device page the daemon hands out is owned by exactly one session until that session
inserts it, frees it, or ends. A session ends by goodbye or when its lease runs out (a killed
engine sends nothing more); either way ``SessionTable.end`` returns what must be given back:
the pages it still owns and the locks it still holds. The table never touches the cache itself:
the handlers do, so that this module stays a plain, testable bookkeeping object.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from hicache.node import TreeNode
from hicache.protocol import DEFAULT_LEASE_S, ErrorCode, ProtocolError


@dataclass
class Session:
    id: int  # never reused within one daemon run
    client: str  # the engine's self-reported name (for `hicache info`)
    pid: int  # the engine's self-reported pid
    lease_s: float  # lifetime without messages
    expires: float  # monotonic deadline; renewed by every message
    owned: set[int] = field(default_factory=set)  # device pages allocated, not inserted or freed
    locks: dict[int, TreeNode] = field(default_factory=dict)  # lock id -> node locked for it
    _lock_ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def add_lock(self, node: TreeNode) -> int:
        """Record a lock taken for this session; returns its id (what RELEASE names)."""
        lock_id = next(self._lock_ids)
        self.locks[lock_id] = node
        return lock_id

    def pop_lock(self, lock_id: int) -> TreeNode:
        try:
            return self.locks.pop(lock_id)
        except KeyError:
            raise ProtocolError(ErrorCode.NOT_OWNED, f"lock {lock_id} is not held") from None

    def check_owned(self, pages: Iterable[int]) -> None:
        """Raise NOT_OWNED unless every page is this session's."""
        missing = [p for p in pages if p not in self.owned]
        if missing:
            raise ProtocolError(
                ErrorCode.NOT_OWNED, f"{len(missing)} page(s) not owned by this session"
            )


@dataclass(frozen=True)
class Ended:
    """What an ended session leaves to give back."""

    session: Session
    reason: str  # "goodbye" or "lease expired"


class SessionTable:
    def __init__(self, lease_s: float = DEFAULT_LEASE_S):
        if lease_s <= 0:
            raise ValueError(f"lease_seconds: must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def open(self, client: str, pid: int, now: float) -> Session:
        session = Session(next(self._ids), client, pid, self.lease_s, now + self.lease_s)
        self._sessions[session.id] = session
        return session

    def touch(self, session_id: int, now: float) -> Session:
        """The live session ``session_id``, its lease renewed; UNKNOWN_SESSION otherwise."""
        session = self._sessions.get(session_id)
        if session is None or session.expires < now:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"no live session {session_id}")
        session.expires = now + session.lease_s
        return session

    def end(self, session_id: int, reason: str = "goodbye") -> Ended | None:
        session = self._sessions.pop(session_id, None)
        return None if session is None else Ended(session, reason)

    def expire(self, now: float) -> list[Ended]:
        """End every session whose lease ran out before ``now``."""
        dead = [s.id for s in self._sessions.values() if s.expires < now]
        return [self.end(sid, "lease expired") for sid in dead]  # type: ignore[misc]

    def owner_of(self, page: int) -> Session | None:
        """The session owning ``page`` (linear; for error messages and tests)."""
        return next((s for s in self._sessions.values() if page in s.owned), None)
