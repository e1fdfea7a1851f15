"""SessionLink: one session with the daemon, shared by every thread of an engine process.

What it holds (and the HiCacheClient in front of it does not):

- one DEALER connection per calling thread, all naming the same session (key and epoch), so
  threads never share a socket, replies never cross, and calls of different threads are in
  flight at once; the heartbeat has a connection of its own;
- what the session learned: ``lost`` (EpochChanged or LeaseLost, sticky until ``reconnect``)
  and when the daemon last answered;
- what late replies brought (a lock, slots of a request that timed out), given back on the
  next call;
- the lifetime: ``close`` (from any thread: calls in flight end with ClientClosed, then the
  sockets close and the daemon is told goodbye) also runs when the HiCacheClient is collected
  or the process exits, because nothing here refers back to the client.

Thread-safe: the mutable parts are guarded by ``_lock`` (connections, give-backs) or are single
assignments read without it (``lost``, ``heard``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from hicache.client.connection import (
    SLICE_MS,
    ClientClosed,
    Connection,
    DaemonError,
    DaemonTimeout,
    EpochChanged,
    LeaseLost,
    hello_fields,
)
from hicache.client.trust import trusted_uids
from hicache.protocol import (
    ENGINE_REPORT_MAX,
    HEARTBEAT_INTERVAL_S,
    ErrorCode,
    HeartbeatReply,
    HelloReply,
    LockReply,
    MatchEntry,
    Op,
    Reply,
    ReportRequest,
)

GIVE_BACK_OPS = (Op.MATCH, Op.INSERT, Op.LOCK, Op.ALLOC, Op.ALLOC_EXTEND, Op.ALLOC_DECODE)

log = logging.getLogger("hicache.client")


class SessionLink:
    def __init__(
        self,
        endpoint: str,
        name: str,
        timeout_s: float,
        admin: bool,
        beat: bool,
        daemon_user: str | int | None = None,
    ):
        self.endpoint, self.name, self.timeout_s, self.admin = endpoint, name, timeout_s, admin
        self.trusted = trusted_uids(daemon_user)  # who the daemon may run as (client/trust.py)
        self.daemon_uid: int | None = None  # who it runs as (None: a CurveZMQ daemon)
        self._lock = threading.Lock()
        self._reconnecting = threading.Lock()
        self._closing = threading.Event()  # close() began: calls in flight end, new ones refuse
        self._local = threading.local()
        self._conns: dict[int, tuple[threading.Thread, Connection]] = {}  # by thread id
        self.closed = False  # close() began: new calls refuse, calls in flight end
        self._owed: list[tuple[Op, dict, list]] = []  # give-backs for late replies
        self._pid = os.getpid()
        self.generation = 0  # +1 per (re)connect: Matches of an older one are void
        self.draining = False  # the daemon said it is shutting down (heartbeat replies)
        self.on_draining: Callable[[], None] | None = None  # called once, on the heartbeat thread
        self._beat_wanted = beat
        self._noted = [0, 0, 0]  # the engine's figures not yet reported (note_engine)
        self._noted_lock = threading.Lock()
        self._beat: threading.Thread | None = None
        self._stop_beat = threading.Event()
        self._open()

    # ---- opening ----------------------------------------------------------------------------
    def _open(self) -> None:
        """hello on a fresh connection; (re)starts the heartbeat."""
        if self._beat is not None and self._beat is not threading.current_thread():
            self._stop_beat.set()  # the old session's heartbeat ends before the new one starts
            self._beat.join()
        conn = self._new_conn()
        sent = time.monotonic()
        reply, _ = conn.call(Op.HELLO, hello_fields(self.name, self.admin, self.endpoint))
        self.daemon_uid = conn.daemon_uid
        self.info = HelloReply.read(reply.fields).fields()  # (checked; a dict: client.info)
        self.key, self.epoch = reply.fields["session"], conn.epoch
        conn.session = self.key
        self.lease_s = float(self.info["lease_s"])
        self.lost: DaemonError | None = None
        self.heard = time.monotonic()  # when the daemon last answered this session
        # when the latest request the daemon answered was sent: the session lives (its locks
        # and pages are held) at least until this plus lease_s
        self.renewed = sent
        self.generation += 1
        self._install(conn)  # (another thread's old connection is closed by that thread)
        if self._beat_wanted:
            self._stop_beat = threading.Event()
            self._beat = threading.Thread(
                target=_heartbeat,
                args=(self, self._stop_beat, self.generation),
                daemon=True,
                name="hicache-heartbeat",
            )
            self._beat.start()

    def _new_conn(self) -> Connection:
        conn = Connection(self.endpoint, self.timeout_s, self._closing, self.trusted)
        conn.on_late = self._late
        return conn

    def reconnect(self, generation: int) -> bool:
        """Open a new session if this link is still at ``generation`` and its session is lost
        (EpochChanged, LeaseLost); True when this call did it. Threads that all saw the same
        loss call it at once: one reconnects, the others find it done."""
        with self._reconnecting:
            if self.generation != generation or self.lost is None or self.closed:
                return False
            self._open()
            return True

    # ---- calls --------------------------------------------------------------------------------
    def conn(self) -> Connection:
        """This thread's connection (made on its first call)."""
        if os.getpid() != self._pid:
            raise RuntimeError("a HiCacheClient cannot be used after fork; make a new one")
        mine = getattr(self._local, "conn", None)
        if mine is not None and mine[0] == self.generation:
            return mine[1]
        conn = self._new_conn()
        conn.session, conn.epoch = self.key, self.epoch
        self._install(conn)
        return conn

    def _install(self, conn: Connection) -> None:
        """Make ``conn`` this thread's connection; close the one it had from an older session
        (this thread's own socket: no other thread uses it)."""
        with self._lock:
            if self.closed:
                conn.close()
                raise ClientClosed("this HiCacheClient was closed; open a new one")
            self._reap()
            old = self._conns.pop(threading.get_ident(), None)
            self._conns[threading.get_ident()] = (threading.current_thread(), conn)
        self._local.conn = (self.generation, conn)
        if old is not None and old[1] is not conn:
            old[1].close()

    def _reap(self) -> None:
        """Close the connections of threads that ended (their sockets are idle for good)."""
        for ident, (thread, conn) in list(self._conns.items()):
            if not thread.is_alive():
                conn.close()
                del self._conns[ident]

    def call(
        self,
        op: Op,
        fields: dict | None = None,
        frames: list | tuple = (),
        timeout_s: float | None = None,
    ) -> tuple:
        """One request of the session on this thread's connection. Raises what the session
        learned before (EpochChanged, LeaseLost), ClientClosed, or the call's own error."""
        if self.lost is not None or self.closed:
            self.raise_if_lost()
        conn, generation = self.conn(), self.generation
        conn.busy = True  # (close() waits for busy connections; it sets `closed` first)
        try:
            if self.closed:
                raise ClientClosed("this HiCacheClient was closed; open a new one")
            if self._owed:
                self._give_back_late(conn)
            sent = time.monotonic()
            reply, out = conn.call(op, fields, frames, timeout_s)
        except (EpochChanged, LeaseLost) as exc:
            self._lose(exc, generation)
            raise
        finally:
            conn.busy = False
        self.heard = time.monotonic()
        if generation == self.generation:
            self.renewed = max(self.renewed, sent)
        return reply, out

    def lease_holds(self) -> bool:
        """Whether the session surely still holds its locks and pages: its lease, renewed by
        the latest request the daemon answered, cannot have run out yet (the daemon's clock
        counts no faster than this one)."""
        return self.lost is None and time.monotonic() - self.renewed < self.lease_s

    def post(self, op: Op, fields: dict | None = None, frames: list | tuple = ()) -> None:
        """One request of the session on this thread's connection, not waited for (see
        Connection.post): what it fails of is not known. Raises what ``call`` raises before
        sending."""
        if self.lost is not None or self.closed:
            self.raise_if_lost()
        conn = self.conn()
        conn.busy = True
        try:
            if self.closed:
                raise ClientClosed("this HiCacheClient was closed; open a new one")
            conn.post(op, fields, frames)
        finally:
            conn.busy = False

    def raise_if_lost(self) -> None:
        if self.closed:
            raise ClientClosed("this HiCacheClient was closed; open a new one")
        lost = self.lost
        if lost is not None:
            raise type(lost)(lost.code, lost.message)

    def _lose(self, exc: DaemonError, generation: int) -> None:
        """Record what ended the session of ``generation`` (a call or beat of an older one,
        finishing after a reconnect, says nothing about the new session)."""
        if self.lost is None and generation == self.generation:
            self.lost = exc

    # ---- late replies ---------------------------------------------------------------------
    def _late(self, op: Op, reply: Reply, frames: list) -> None:
        """A request that timed out ran after all: note what to give back of what its reply
        brought (called inside a later call; the give-back waits for the next one)."""
        owed = _give_backs(op, reply, frames, int(self.info["config"]["page_size"]))
        if owed:
            with self._lock:
                self._owed.extend(owed)

    def _give_back_late(self, conn: Connection) -> None:
        with self._lock:
            owed, self._owed = self._owed, []
        for op, fields, frames in owed:
            with contextlib.suppress(DaemonError, DaemonTimeout):
                conn.call(op, fields, frames)

    # ---- liveness ---------------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise unless the daemon answered within a lease (DaemonTimeout), in this life
        (EpochChanged) and for a session still alive (LeaseLost)."""
        self.raise_if_lost()
        if self._beat is not None and self._beat.is_alive():
            silent = time.monotonic() - self.heard
            if silent > self.lease_s:
                raise DaemonTimeout(f"the daemon has not answered for {silent:.1f} s")
            return
        probe = Connection(
            self.endpoint, min(self.timeout_s, self.lease_s), self._closing, self.trusted
        )
        probe.session, probe.epoch, generation = self.key, self.epoch, self.generation
        try:
            probe.call(Op.HEARTBEAT)
        except (EpochChanged, LeaseLost) as exc:
            self._lose(exc, generation)
            raise
        finally:
            probe.close()
        self.heard = time.monotonic()

    # ---- the engine's figures ------------------------------------------------------------
    def note_engine(self, queried: int, hit: int, loaded: int) -> None:
        """From any thread: the engine's figures grew (HiCacheClient.note_engine); the next
        heartbeat, or the goodbye, reports them."""
        with self._noted_lock:
            noted = self._noted
            noted[0] += queried
            noted[1] += hit
            noted[2] += loaded

    def _report(self, stopping: bool = False) -> dict | None:
        """The fields that report what was noted since the last report (taken)."""
        with self._noted_lock:
            noted, self._noted = self._noted, [0, 0, 0]
        top = ENGINE_REPORT_MAX - 1  # (a report over the bound would be refused whole)
        queried, hit, loaded = (min(top, n) for n in noted)
        return ReportRequest(queried, hit, loaded, stopping).fields() or None

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self, stopping: bool = False) -> None:
        """From any thread, once: calls in flight end (ClientClosed), the heartbeat stops, the
        daemon is told goodbye (it frees what the session held; ``stopping``: after its
        quarantine, as copies this process started may still run) and every socket closes."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._closing.set()  # waits for replies look at it every SLICE_MS
            conns = [c for _, c in self._conns.values()]
            self._conns = {}
        deadline = time.monotonic() + 10 * SLICE_MS / 1000
        while any(c.busy for c in conns) and time.monotonic() < deadline:
            time.sleep(0.005)  # calls in flight end within one receive slice
        self._stop_beat.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join()
        if os.getpid() == self._pid:
            with contextlib.suppress(Exception):  # daemon gone or restarted: nothing to give
                goodbye = Connection(self.endpoint, min(self.timeout_s, 2.0), None, self.trusted)
                goodbye.session, goodbye.epoch = self.key, self.epoch
                try:
                    goodbye.call(Op.GOODBYE, self._report(stopping))
                finally:
                    goodbye.close()
        for conn in conns:
            if not conn.busy:  # (one still busy after the wait is left to the collector)
                conn.close()


def _give_backs(op: Op, reply: Reply, frames: list, page_size: int) -> list:
    """What to give back of a late reply to ``op``: releases of its locks, frees of the pages
    it started (a slot that continues a partly filled page shares it with the request's
    earlier tokens, which the engine still uses: not that page)."""
    if op in (Op.MATCH, Op.INSERT):
        entries = (MatchEntry(*r) for r in reply.fields.get("results", ()))
        ids = [e.lock_id for e in entries if e.lock_id]
        return [(Op.RELEASE, {"lock_ids": ids}, [])] if ids else []
    if op is Op.LOCK and reply.fields.get("lock_id"):
        return [(Op.RELEASE, {"lock_ids": [LockReply.read(reply.fields).lock_id]}, [])]
    if op is Op.ALLOC and frames:
        return [(Op.FREE, {}, [bytes(frames[0].buffer)])]
    if op in (Op.ALLOC_EXTEND, Op.ALLOC_DECODE) and frames:
        slots = np.frombuffer(frames[0].buffer, dtype=np.int64)
        new = slots[slots % page_size == 0]
        return [(Op.FREE, {}, [new.tobytes()])] if len(new) else []
    return []


def _heartbeat(link: SessionLink, stop: threading.Event, generation: int) -> None:
    """Beat at least three times per lease, so one lost beat never ends a live session. Holds
    the link, never the client: a client dropped without close() is still collected. Stops
    on EpochChanged, LeaseLost or an unknown session (every later call raises it)."""
    interval = min(HEARTBEAT_INTERVAL_S, link.lease_s / 3)
    try:
        conn = Connection(link.endpoint, interval * 2, None, link.trusted)
    except (DaemonTimeout, PermissionError):  # gone (or replaced) since the hello: calls tell
        return
    conn.session, conn.epoch = link.key, link.epoch
    try:
        while not stop.wait(interval) and link.lost is None:
            try:
                sent = time.monotonic()
                reply, _ = conn.call(Op.HEARTBEAT, link._report())
                link.heard = time.monotonic()
                if generation == link.generation:
                    link.renewed = max(link.renewed, sent)
                if HeartbeatReply.read(reply.fields).draining and not link.draining:
                    link.draining = True
                    if link.on_draining is not None:
                        try:
                            link.on_draining()
                        except Exception:  # noqa: BLE001 (the engine's; the beat goes on)
                            log.exception("hicache: the engine's on_draining failed")
                    log.warning("hicache-daemon at %s is shutting down", link.endpoint)
            except (EpochChanged, LeaseLost) as exc:
                link._lose(exc, generation)
            except DaemonError as exc:
                if exc.code is ErrorCode.UNKNOWN_SESSION:
                    link._lose(LeaseLost(exc.code, exc.message), generation)
            except DaemonTimeout:  # the daemon is busy or gone: calls will tell
                pass
    finally:
        conn.close()
