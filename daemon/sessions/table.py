"""Sessions: who owns which device pages and holds which locks, and for how long.

Every device page the daemon hands out is owned by exactly one session until that session
inserts it, frees it, or ends. A session ends by goodbye, or its lease runs out (a killed or
stalled engine sends nothing more). A lapsed session is not given back at once: it stays in
quarantine for ``quarantine_s``, still holding its pages and locks, so that an engine that was
only stalled (SIGSTOP, swapping, a debugger) and writes on into its pages when it resumes
cannot write into pages already handed to someone else. Its requests are refused with
``LEASE_EXPIRED`` from the moment the lease lapsed; a goodbye ends the quarantine early.

A session has two numbers: ``id``, small and public (stats and logs name sessions by it), and
``key``, a random 62-bit number only its client learns (from hello) and sends with every
request. Knowing a session's id (any peer can read stats) does not let a peer act as it.

Leases run on a ``ServiceClock``: time the daemon itself was not running (paused, a frozen VM,
one long operation on its only thread) does not count against its clients, who could not be
heard meanwhile.

The table never touches the cache itself: the handlers do, so this module stays a plain,
testable bookkeeping object. Control thread only.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hicache.daemon.sessions.engine_counts import EngineCounts
from hicache.daemon.transport import LOCAL_USER, USER_SHARE
from hicache.errors import IntegrityError
from hicache.protocol import DEFAULT_LEASE_S, ErrorCode, ProtocolError

FORGET_AFTER = 65536  # lapsed session keys remembered (to answer LEASE_EXPIRED, not UNKNOWN)
DEFAULT_MAX_SESSIONS = 4096  # live and quarantined sessions at once
MAX_SESSIONS_PER_PEER = 16  # sessions one connection may have open (an engine opens one)


def holder(user: str) -> str:
    """What a session's ``user`` names, for a message: a local user or a CurveZMQ key."""
    return "local user" if user.startswith(LOCAL_USER) else "client key"


def process_pid(process: str) -> int:
    """The pid in a session's ``process`` ("<pid>@<start time>"); 0 for "" (none)."""
    return int(process.split("@")[0]) if process else 0


class ServiceClock:
    """Seconds the daemon has been running: monotonic time minus the part of every gap between
    two readings beyond ``max_gap``. The control loop reads it at least every 50 ms while it
    runs, so only a pause (or one operation longer than ``max_gap``) loses time."""

    def __init__(self, max_gap: float = 1.0, source: Callable[[], float] = time.monotonic):
        if max_gap <= 0:
            raise ValueError(f"max_gap: must be > 0, got {max_gap}")
        self.max_gap = max_gap
        self.source = source
        self._last = source()
        self.skipped = 0.0  # seconds not counted so far

    def __call__(self) -> float:
        now = self.source()
        gap = now - self._last
        if gap > self.max_gap:
            self.skipped += gap - self.max_gap
        self._last = now
        return now - self.skipped


@dataclass
class Session:
    id: int  # public, small, never reused within one daemon run
    key: int  # secret: what requests name the session by (random, 62 bits)
    client: str  # the engine's self-reported name (for `hicache info`)
    pid: int  # the engine's self-reported pid
    lease_s: float  # lifetime without messages
    expires: float  # service-clock deadline; renewed by every message
    admin: bool = False  # may flush and evict for everyone
    owned: set[int] = field(default_factory=set)  # device pages allocated, not inserted or freed
    locks: dict[int, Any] = field(default_factory=dict)  # lock id -> what the handlers locked
    pinned_pages: int = 0  # device pages its locks made unevictable (its records' ``pinned``)
    peer: bytes = b""  # the connection (ROUTER routing id) that opened it
    user: str = ""  # the CurveZMQ client key it came with ("": ipc or plain tcp)
    # over ipc: the process that opened its connection, as the kernel gives it ("<pid>@<start
    # time>", inbox.process); "": tcp, or unknown
    process: str = ""
    # the live and quarantined sessions of ``user`` (itself among them; none without a key):
    # what the key holds in all is bounded like one session's (limits.check_owned)
    fellows: list[Session] = field(default_factory=list, repr=False, compare=False)
    tally: list[int] = field(default_factory=lambda: [0])  # locks of all its table's sessions
    loads: set[int] = field(default_factory=set)  # tickets of loads this session started
    release_at: float = 0.0  # in quarantine: when its pages and locks are given back
    ending: str = "lease expired"  # why it is in quarantine (said when it ends)
    queried_tokens: int = 0  # tokens this session asked MATCH about (`hicache info sessions`)
    hit_tokens: int = 0  # of them, found cached (device and host)
    engine: EngineCounts = field(default_factory=EngineCounts)  # as the engine counts them
    _lock_ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def add_lock(self, record: Any) -> int:
        """Record a lock taken for this session; returns its id (what RELEASE names)."""
        lock_id = next(self._lock_ids)
        self.locks[lock_id] = record
        self.tally[0] += 1
        return lock_id

    def pop_lock(self, lock_id: int) -> Any:
        try:
            record = self.locks.pop(lock_id)
        except KeyError:
            raise ProtocolError(ErrorCode.NOT_OWNED, f"lock {lock_id} is not held") from None
        self.pinned_pages -= getattr(record, "pinned", 0)  # (records are the handlers')
        self.tally[0] -= 1
        return record

    def drop_locks(self) -> list[Any]:
        """Forget every lock (the session ended); returns their records to release."""
        records = list(self.locks.values())
        self.locks.clear()
        self.pinned_pages = 0
        self.tally[0] -= len(records)
        return records

    def owns_all(self, pages: Iterable[int]) -> bool:
        return self.owned.issuperset(pages)

    def check_owned(self, pages: Iterable[int]) -> None:
        """Raise NOT_OWNED unless every page is this session's."""
        missing = [p for p in pages if p not in self.owned]
        if missing:
            raise ProtocolError(
                ErrorCode.NOT_OWNED,
                f"{len(missing)} page(s) not owned by this session (e.g. page {missing[0]}: "
                "freed already, inserted, another session's, or never allocated)",
            )


@dataclass(frozen=True)
class Ended:
    """What an ended session leaves to give back."""

    session: Session
    reason: str  # "goodbye" or "lease expired"


class SessionTable:
    def __init__(
        self,
        lease_s: float = DEFAULT_LEASE_S,
        quarantine_s: float | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ):
        if lease_s <= 0:
            raise ValueError(f"lease_seconds: must be > 0, got {lease_s}")
        quarantine_s = lease_s if quarantine_s is None else quarantine_s
        if quarantine_s < 0:
            raise ValueError(f"quarantine_seconds: must be >= 0, got {quarantine_s}")
        self.lease_s = lease_s
        self.quarantine_s = quarantine_s
        self.max_sessions = max_sessions
        self._sessions: dict[int, Session] = {}  # live, by key
        self._quarantine: dict[int, Session] = {}  # lapsed, still holding what they held
        self._lapsed: OrderedDict[int, None] = OrderedDict()  # keys whose lease ran out
        self._ids = itertools.count(1)
        self.leases_expired = 0  # live sessions whose lease ran out (not goodbyes)
        self._per_peer: Counter[bytes] = Counter()  # live and quarantined sessions by peer
        self._per_user: Counter[str] = Counter()  # the same by CurveZMQ client key
        self._per_process: Counter[str] = Counter()  # ... and by process (ipc)
        self._by_user: dict[str, list[Session]] = {}  # those sessions (each one's ``fellows``)
        # sessions one client key, or one process over ipc, may hold (plain tcp: no bound but
        # max_sessions)
        self.max_per_user = max(MAX_SESSIONS_PER_PEER, max_sessions // USER_SHARE)
        self.locks = [0]  # locks every session holds (each session's ``tally``)

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def quarantined(self) -> list[Session]:
        return list(self._quarantine.values())

    def holders(self) -> Iterator[Session]:
        """Every session that holds pages or locks: live and quarantined."""
        yield from list(self._sessions.values())
        yield from list(self._quarantine.values())

    def open(
        self,
        client: str,
        pid: int,
        now: float,
        admin: bool = False,
        peer: bytes = b"",
        user: str = "",
        process: str = "",
    ) -> Session:
        """A new live session; QUOTA_EXCEEDED when max_sessions already hold memory, when
        ``peer`` (the connection asking) has MAX_SESSIONS_PER_PEER open already (an engine
        opens one per connection, and one socket must not take every session there is), or
        when ``user`` (its CurveZMQ key; on tcp without keys its local uid, LOCAL_USER) or
        ``process`` (the process that opened an ipc connection) holds its share of
        max_sessions over connections."""
        if len(self._sessions) + len(self._quarantine) >= self.max_sessions:
            raise ProtocolError(
                ErrorCode.QUOTA_EXCEEDED,
                f"{self.max_sessions} sessions are open already (--max-sessions)",
            )
        if peer and self._per_peer[peer] >= MAX_SESSIONS_PER_PEER:
            raise ProtocolError(
                ErrorCode.QUOTA_EXCEEDED,
                f"this connection opened {MAX_SESSIONS_PER_PEER} sessions already (one per "
                "HiCacheClient): close some first",
            )
        key_or_uid = f"this {holder(user)}"
        for who, count, name in (
            (user, self._per_user, key_or_uid),
            (process, self._per_process, f"this process (pid {process_pid(process)})"),
        ):
            if who and count[who] >= self.max_per_user:
                raise ProtocolError(
                    ErrorCode.QUOTA_EXCEEDED,
                    f"{name} holds {self.max_per_user} sessions already over its connections "
                    f"(a 1/{USER_SHARE} share of --max-sessions): close some first",
                )
        key = secrets.randbits(62) | 1
        session = Session(
            next(self._ids),
            key,
            client,
            pid,
            self.lease_s,
            now + self.lease_s,
            admin,
            peer=peer,
            user=user,
            process=process,
            tally=self.locks,
        )
        self._sessions[key] = session
        if peer:
            self._per_peer[peer] += 1
        if process:
            self._per_process[process] += 1
        if user:
            self._per_user[user] += 1
            session.fellows = self._by_user.setdefault(user, [])
            session.fellows.append(session)
        return session

    def _gone(self, session: Session) -> Session:
        """Forget ``session``'s place in the per-peer, per-user and per-process counts (it
        ended)."""
        counts: tuple[tuple[Counter[Any], bytes | str], ...] = (
            (self._per_peer, session.peer),
            (self._per_user, session.user),
            (self._per_process, session.process),
        )
        for count, who in counts:
            if who:
                count[who] -= 1
                if not count[who]:
                    del count[who]
        if session.fellows:
            session.fellows.remove(session)
            if not session.fellows:
                del self._by_user[session.user]
        return session

    def live(self, key: int, now: float) -> Session | None:
        """The live session named by ``key`` (its lease left as it is), or None."""
        session = self._sessions.get(key)
        return session if session is not None and session.expires >= now else None

    def touch(self, key: int, now: float) -> Session:
        """The live session named by ``key``, its lease renewed. LEASE_EXPIRED for a session
        whose lease ran out (it must not act any more), UNKNOWN_SESSION otherwise."""
        session = self._sessions.get(key)
        if session is not None and session.expires >= now:
            session.expires = now + session.lease_s
            return session
        if session is not None or key in self._lapsed:
            raise ProtocolError(
                ErrorCode.LEASE_EXPIRED,
                "this session's lease ran out; its locks and pages are taken back",
            )
        raise ProtocolError(ErrorCode.UNKNOWN_SESSION, "no live session by that key")

    def end(self, key: int, reason: str = "goodbye") -> Ended | None:
        """End a live or quarantined session now; None when there is none by that key."""
        session = self._sessions.pop(key, None) or self._quarantine.pop(key, None)
        return None if session is None else Ended(self._gone(session), reason)

    def stop(self, key: int, now: float) -> Session | None:
        """An engine says it is stopping (copies it started may still run): its lease ends
        now and it goes to quarantine as a lapsed one would, without the lease's wait. None
        when no live session has that key."""
        session = self._sessions.pop(key, None)
        if session is None:
            return None
        session.expires, session.release_at = now, now + self.quarantine_s
        session.ending = "stopped"
        self._quarantine[key] = session
        self._lapsed[key] = None
        if len(self._lapsed) > FORGET_AFTER:
            self._lapsed.popitem(last=False)
        return session

    def orphaned(self, now: float, alive: Callable[[str], bool]) -> list[Session]:
        """Put in quarantine at once, as a stopping goodbye would, every live session whose
        connection's process (ipc) is gone: an engine killed before it could say goodbye
        (SIGKILL, the OOM killer) holds nothing for its lease's length. Returns them."""
        gone = []
        for process in {s.process for s in self._sessions.values() if s.process}:
            if alive(process):
                continue
            for key in [k for k, s in self._sessions.items() if s.process == process]:
                session = self.stop(key, now)
                if session is not None:
                    session.ending = f"its process (pid {process_pid(process)}) ended"
                    gone.append(session)
        return gone

    def expire(self, now: float) -> list[Ended]:
        """Move every session whose lease ran out before ``now`` to quarantine, and return the
        quarantined ones whose grace period is over (to give back now)."""
        for key in [s.key for s in self._sessions.values() if s.expires < now]:
            session = self._sessions.pop(key)
            session.release_at = session.expires + self.quarantine_s
            self.leases_expired += 1
            self._quarantine[key] = session
            self._lapsed[key] = None
            if len(self._lapsed) > FORGET_AFTER:
                self._lapsed.popitem(last=False)
        due = [s.key for s in self._quarantine.values() if s.release_at <= now]
        return [Ended(self._gone(s := self._quarantine.pop(key)), s.ending) for key in due]

    def check_integrity(self) -> None:
        """The per-connection, per-key and per-process counts, and each key's sessions
        (``fellows``), are those of the live and quarantined sessions. Raises IntegrityError."""
        peers: Counter[bytes] = Counter()
        processes: Counter[str] = Counter()
        users: dict[str, list[Session]] = {}
        for s in self.holders():
            if s.peer:
                peers[s.peer] += 1
            if s.process:
                processes[s.process] += 1
            if s.user:
                users.setdefault(s.user, []).append(s)
            elif s.fellows:
                raise IntegrityError(f"session {s.id} has no client key and fellows")
        if peers != self._per_peer:
            raise IntegrityError("sessions per connection are miscounted")
        if processes != self._per_process:
            raise IntegrityError("sessions per process are miscounted")
        if {u: len(ss) for u, ss in users.items()} != dict(self._per_user):
            raise IntegrityError("sessions per client key are miscounted")
        for user, sessions in users.items():
            fellows = self._by_user.get(user)
            if fellows is None or sorted(s.id for s in fellows) != sorted(s.id for s in sessions):
                raise IntegrityError(f"the sessions of a client key are not {len(sessions)}")
            if any(s.fellows is not fellows for s in sessions):
                raise IntegrityError("a session's fellows are not its client key's sessions")
        if set(self._by_user) != set(users):
            raise IntegrityError("a client key without sessions is still listed")

    def owner_of(self, page: int) -> Session | None:
        """The session owning ``page`` (linear; for error messages and tests)."""
        return next((s for s in self.holders() if page in s.owned), None)
