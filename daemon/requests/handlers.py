"""Request handlers: decode a request, act on the cache for a session, encode the reply.

No sockets here (server.py moves frames). ``Handlers.handle`` never raises: a bad request gets
an error reply with a stable code, an unexpected exception an INTERNAL reply, and the daemon
keeps serving. Handlers run on the control thread only.

Order of checks for every request, before anything changes: the header decodes; the request
names this daemon life (``epoch``, else ``EPOCH_MISMATCH``); its session is live (else
``LEASE_EXPIRED`` or ``UNKNOWN_SESSION``); an admin operation comes from an admin session
(else ``FORBIDDEN``). Only then does the operation run.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hicache import __version__
from hicache.cache import HiRadixCache
from hicache.daemon.requests.admin_ops import AdminOps
from hicache.daemon.requests.cache_ops import CacheOps
from hicache.daemon.requests.capacity_feed import CapacityFeed
from hicache.daemon.requests.context import NO_CALL, Call, Transport
from hicache.daemon.requests.engine_tier import EngineTier, no_layout
from hicache.daemon.requests.integrity import check_sessions
from hicache.daemon.requests.l3_waits import Deferred
from hicache.daemon.requests.latency import RequestStats
from hicache.daemon.requests.tier_names import TierNames
from hicache.daemon.requests.tree_reply import tree_reply
from hicache.daemon.requests.view_budget import ViewBudget
from hicache.daemon.sessions import (
    SATURATED,
    Ended,
    EngineCounts,
    ServiceClock,
    Session,
    SessionLimits,
    SessionTable,
    process_pid,
    reported,
)
from hicache.daemon.transport import process_alive
from hicache.errors import HiCacheError, InvalidIndicesError
from hicache.memory import OWNED
from hicache.observe import CacheStats
from hicache.protocol import (
    MAX_MATCH_TOKENS,
    PROTOCOL_VERSION,
    ErrorCode,
    HeartbeatReply,
    HelloReply,
    HelloRequest,
    HoldingsReply,
    Op,
    PingReply,
    ProtocolError,
    RegisterReply,
    RegisterRequest,
    Reply,
    ReportRequest,
    StatsRequest,
    TreeRequest,
    bool_field,
    decode_request,
    encode_reply,
)

log = logging.getLogger("hicache.daemon")
Frames = list[Any]
Result = tuple[dict[str, Any], Frames]
NO_SESSION_OPS = {Op.HELLO, Op.PING, Op.STATS}
ADMIN_OPS = {Op.EVICT, Op.FLUSH}
# what a daemon for engine-owned device tiers answers before an engine registered its layout
NO_CACHE_OPS = NO_SESSION_OPS | {Op.HEARTBEAT, Op.GOODBYE, Op.REGISTER, Op.HOLDINGS}
MAX_SESSION_LIST = 1000  # sessions listed by stats (the count is always exact)
CHEAP_SESSION_LIST = 64  # a stats report listing no more live sessions is no view (no budget)
PROCESS_CHECK_S = 1.0  # how often housekeeping looks whether sessions' engine processes live


def printable(name: str) -> str:
    """``name`` with every character that is not printable (terminal escapes, newlines that
    would fake a log line) written as its Python escape."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


class Handlers:
    def __init__(
        self,
        cache: HiRadixCache | None,
        sessions: SessionTable,
        boot_epoch: int,
        info: dict[str, Any],
        clock: Callable[[], float] | None = None,
        limits: SessionLimits | None = None,
        admin_token: str | None = None,
        engine_tier: EngineTier | None = None,
        transport: Transport | None = None,
    ):
        self.cache = cache  # None until an engine registers its layout (device_tier=engine)
        # the hit-ratio-against-capacity estimate (fed by matches and inserts)
        self.capacity = None if cache is None else CapacityFeed.for_cache(cache, engine_tier)
        self.engine_tier = engine_tier  # device_tier=engine: the layout engines register
        self.tiers = TierNames(engine_tier is not None)  # how reports name the cache's pools
        self.sessions = sessions
        self.boot_epoch = boot_epoch
        self.info = info  # hello's config and pool description, and server facts for stats
        # leases run on the service clock: time the daemon was not running does not count
        self.clock = clock or ServiceClock(max_gap=min(1.0, sessions.lease_s / 4))
        self.limits = limits or SessionLimits.for_pool(
            0 if cache is None else cache.device_capacity_pages
        )
        self.admin_token = admin_token  # what an admin hello must show (None: no admins)
        self.started = self.clock()
        self._processes_seen = self.started  # when housekeeping last looked for ended engines
        self.housekeep_errors = 0  # exceptions caught in housekeeping (each one is a bug)
        self.draining = False  # shutting down: hello is refused, heartbeats say so
        self.transport = transport or Transport()  # what the server's transport tells
        self.requests = RequestStats()  # latency per op, errors by code (metrics)
        self.engine_counts = EngineCounts()  # engines' own figures, all sessions (ended too)
        self.op = "unknown"  # the op of the request being handled
        self.views = ViewBudget()  # the loop's time for whole-cache views (check, tree)
        # each op's handler: given a Session (an op that needs one), or a Session or None
        # (NO_SESSION_OPS), as _handle checked it: Any, the one type both kinds take
        self.table: dict[Op, Callable[[Any, dict, Frames, Call], Result]] = {
            Op.HELLO: self.hello,
            Op.HEARTBEAT: self.heartbeat,
            Op.CAPACITY: self.capacity_report,
            Op.STATS: self.stats,
            Op.TREE: self.tree,
            Op.PING: self.ping,
            Op.HOLDINGS: self.holdings,
            Op.REGISTER: self.register,
        }
        self.ops: CacheOps | None = None  # the sessions' cache operations (once there is one)
        self.admin: AdminOps | None = None  # the operator's (evict, flush), likewise
        if cache is not None:
            self._compose_ops()

    def _compose_ops(self) -> None:
        """The cache operations over the cache there is now (at start, or once an engine
        registered its layout), their ops added to the table."""
        assert self.cache is not None  # (called once there is one)
        self.ops = CacheOps(
            self.cache, self.limits, self.capacity, self.sessions, self.transport.others_waiting
        )
        self.table.update(self.ops.table())
        self.admin = AdminOps(self.cache, self.tiers)
        self.table.update(self.admin.table())

    # ---- transport-facing -------------------------------------------------------------------
    def handle(
        self,
        header: bytes | memoryview,
        frames: Frames,
        call: Call = NO_CALL,
    ) -> tuple[bytes | None, Frames | Deferred]:
        """The reply to one request that came on ``call.peer``, or ``(None, Deferred)`` for a
        match that should wait for the third tier (only when ``call.may_wait``)."""
        started, self.op = time.perf_counter(), "unknown"
        try:
            return self._handle(header, frames, call)
        except Deferred as waiting:
            return None, waiting
        finally:
            self.requests.record(self.op, time.perf_counter() - started)

    def _handle(
        self, header: bytes | memoryview, frames: Frames, call: Call
    ) -> tuple[bytes, Frames]:
        request_id = 0
        try:
            req = decode_request(header)
            request_id, self.op = req.request_id, req.op.name.lower()
            session = None
            if req.op is Op.GOODBYE:  # also ends a session in quarantine
                return self._goodbye(req), []
            counts = reported(req.fields)  # (checked before anything changes)
            if req.op not in NO_SESSION_OPS:
                self._check_epoch(req.epoch, required=True)
                session = self.sessions.touch(req.session, self.clock())
                if req.op in ADMIN_OPS and not session.admin:
                    raise ProtocolError(
                        ErrorCode.FORBIDDEN,
                        f"{req.op.name.lower()} acts for every session: open the session as "
                        "admin (HiCacheClient(admin=True), or the hicache CLI)",
                    )
            else:
                self._check_epoch(req.epoch, required=False)
                if req.session:  # (an admin's integrity check is not limited)
                    session = self.sessions.live(req.session, self.clock())
            if counts is not None and session is None:
                raise ProtocolError(
                    ErrorCode.BAD_FIELD,
                    f"engine counts are a session's: {req.op.name.lower()} without a session "
                    "cannot carry them",
                )
            if self.cache is None and req.op not in NO_CACHE_OPS:
                raise no_layout()
            fields, out = self.table[req.op](session, req.fields, frames, call)
            if counts is not None:  # an engine's figures ride on any request that succeeds
                assert session is not None
                session.engine.add(counts)
                self.engine_counts.add(counts)
            return self._reply(ErrorCode.OK, request_id, fields), out
        except Deferred:
            raise  # (handle parks the request)
        except ProtocolError as exc:
            return self._reply(exc.code, request_id, {"message": str(exc)}), []
        except InvalidIndicesError as exc:
            return self._reply(ErrorCode.NOT_OWNED, request_id, {"message": str(exc)}), []
        except (ValueError, TypeError, HiCacheError) as exc:
            return self._reply(ErrorCode.BAD_FIELD, request_id, {"message": str(exc)}), []
        except Exception as exc:  # a daemon bug: report it, keep serving
            log.exception("internal error")
            message = f"internal error: {type(exc).__name__}: {exc}"
            return self._reply(ErrorCode.INTERNAL, request_id, {"message": message}), []

    def _check_epoch(self, epoch: int, required: bool) -> None:
        """A request from another daemon life is refused before anything happens."""
        if epoch == self.boot_epoch or (epoch == 0 and not required):
            return
        raise ProtocolError(
            ErrorCode.EPOCH_MISMATCH,
            "the request belongs to another daemon life (the daemon restarted): its session, "
            "slots and locks are void; open a new client",
        )

    def _reply(self, status: ErrorCode, request_id: int, fields: dict) -> bytes:
        if status is not ErrorCode.OK:
            self.requests.error(status.name)
        return encode_reply(Reply(status, request_id, self.boot_epoch, fields))

    def housekeep(self, estimate: bool = True) -> list[Ended]:
        """Process transfer acks and give back what sessions past their quarantine held; with
        ``estimate``, also count a slice of the capacity feed (the server passes False while
        another client's request waits: a statistic never goes before a request). Never
        raises: a bug here is logged and counted, and the daemon keeps serving."""
        try:
            if self.cache is not None:
                self.cache.poll()
                if self.cache.l3 is not None:  # (never inside a cache operation: it may evict)
                    self.cache.l3.poll()
            now = self.clock()
            if now - self._processes_seen >= PROCESS_CHECK_S:
                self._processes_seen = now
                self._orphans(now)
            ended = self.sessions.expire(now)
            if estimate and self.capacity is not None:
                self.capacity.run()
        except Exception:
            self.housekeep_errors += 1
            log.exception("housekeeping failed")
            return []
        for gone in ended:
            try:
                self.give_back(gone)
            except Exception:
                self.housekeep_errors += 1
                log.exception("giving back session %d failed", gone.session.id)
        return ended

    def _orphans(self, now: float) -> None:
        """Sessions whose engine process is gone go to quarantine now (sessions.orphaned)."""
        for session in self.sessions.orphaned(now, process_alive):
            log.info(
                "session %d (%s) %s: its %d pages and %d locks are given back in %g s",
                session.id,
                session.client,
                session.ending,
                len(session.owned),
                len(session.locks),
                self.sessions.quarantine_s,
            )

    def give_back(self, ended: Ended) -> None:
        """Release every lock and free every page an ended session still held. Only pages the
        allocator still counts as owned are freed: nothing of the tree's or the free list's."""
        session = ended.session
        held = f"{len(session.owned)} pages and {len(session.locks)} locks given back"
        if not session.owned and not session.locks:
            held = "it held nothing"  # (a vLLM worker's session, once its layout is registered)
        log.info("session %d (%s) ended: %s; %s", session.id, session.client, ended.reason, held)
        if self.cache is None:  # nothing can be held before the pool exists
            return
        for record in session.drop_locks():
            self.cache.dec_lock_ref(record.node)
        if session.owned:
            pages = np.fromiter(session.owned, dtype=np.int64)
            pages = pages[self.cache.page_states(pages) == OWNED]
            self.cache.free(pages * self.cache.page_size)
            session.owned.clear()

    # ---- sessions ----
    def hello(self, _: Session | None, fields: dict, frames: Frames, call: Call) -> Result:
        req = HelloRequest.read(fields)
        client = printable(req.client)  # shown in logs, `hicache info` and top: no escapes
        pid, admin = req.pid, req.admin
        if admin:
            token = req.admin_token
            if (
                self.admin_token is None
                or not isinstance(token, str)
                # (as bytes: compare_digest takes only ASCII strs, and a token is any str)
                or not hmac.compare_digest(
                    token.encode("utf-8", "surrogatepass"), self.admin_token.encode()
                )
            ):
                raise ProtocolError(
                    ErrorCode.FORBIDDEN,
                    "an admin session must show the daemon's admin token (the file "
                    "hicache.endpoints.admin_token_path(endpoint) names, readable by its user)",
                )
        if self.draining:
            raise ProtocolError(
                ErrorCode.DRAINING,
                "the daemon is shutting down (draining): no new sessions; connect to the one "
                "that replaces it",
            )
        where = self.transport
        session = self.sessions.open(
            client, pid, self.clock(), admin, call.peer, where.user(), where.process()
        )
        return HelloReply(
            session=session.key,
            session_id=session.id,
            lease_s=session.lease_s,
            quarantine_s=self.sessions.quarantine_s,
            limits={**vars(self.limits), "max_match_tokens": MAX_MATCH_TOKENS},
            **self.info,
        ).fields(), []

    def holdings(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        """What the session holds: its lock ids, and its owned pages as a frame (answered
        before there is a pool too: nothing)."""
        pages = np.fromiter(sorted(session.owned), dtype=np.int64, count=len(session.owned))
        return HoldingsReply(sorted(session.locks), len(pages)).fields(), [pages.tobytes()]

    def heartbeat(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        if ReportRequest.read(fields).stopping:  # (its counts: read as on any request)
            raise ProtocolError(ErrorCode.BAD_FIELD, "stopping: a goodbye's, not a heartbeat's")
        return HeartbeatReply(self.draining).fields(), []

    def _goodbye(self, req: Any) -> bytes:
        """End the session now (live or in quarantine); a stale epoch is refused first."""
        self._check_epoch(req.epoch, required=True)
        refused = None
        try:
            report = ReportRequest.read(req.fields)  # an engine's last figures
        except ProtocolError as exc:  # refused, but the session still ends: its pages come back
            report = ReportRequest(stopping=bool_field(req.fields, "stopping", False))
            refused = exc
        counts = EngineCounts(*report.counts) if any(report.counts) else None
        if report.stopping:
            self._stopping(req, counts)
        else:
            ended = self.sessions.end(req.session)
            if ended is None:
                raise ProtocolError(ErrorCode.UNKNOWN_SESSION, "no session by that key")
            if counts is not None:
                self.engine_counts.add(counts)
            self.give_back(ended)
        if refused is not None:
            message = f"the session ended; its figures were refused: {refused}"
            return self._reply(refused.code, req.request_id, {"message": message})
        return self._reply(ErrorCode.OK, req.request_id, {})

    def _stopping(self, req: Any, counts: EngineCounts | None) -> None:
        """GOODBYE with ``stopping``: the engine's process is stopping and copies it started
        may still write its pages: the session goes to quarantine now (what it holds is given
        back after quarantine_seconds, as after a lapsed lease, without the lease's wait)."""
        session = self.sessions.stop(req.session, self.clock())
        if session is None:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, "no live session by that key")
        if counts is not None:
            session.engine.add(counts)
            self.engine_counts.add(counts)
        log.info(
            "session %d (%s) stopping: its %d pages and %d locks are given back in %g s",
            session.id,
            session.client,
            len(session.owned),
            len(session.locks),
            self.sessions.quarantine_s,
        )

    def ping(self, _: Session | None, fields: dict, frames: Frames, call: Call) -> Result:
        state = "draining" if self.draining else "ready"
        return PingReply(True, os.getpid(), state).fields(), []

    def register(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        """An engine that owns its device tier names its KV layout (engine_tier.py): the first
        one makes the pool; an equal one is accepted, another refused with both named."""
        if self.engine_tier is None:
            raise EngineTier.refusal()
        layout, made = self.engine_tier.register(RegisterRequest.read(fields).layout)
        if made is not None:
            self.cache, self.limits = made.cache, made.limits
            self.capacity = CapacityFeed.for_cache(made.cache, engine_tier=True)
            self.info.update(made.info)
            self._compose_ops()
        info = self.info
        return RegisterReply(layout.as_dict(), info["config"], info["pools"]).fields(), []

    # ---- maintenance (admin) ----
    def stats(self, session: Session | None, fields: dict, frames: Frames, call: Call) -> Result:
        """The daemon's figures, every session listed (up to MAX_SESSION_LIST), and with
        ``check`` its integrity check: within the view budget (``_whole_cache_view``) when it
        checks or lists more than CHEAP_SESSION_LIST live sessions."""
        check = StatsRequest.read(fields).check
        if not check and len(self.sessions) <= CHEAP_SESSION_LIST:  # as cheap as a match
            return self.report(), []
        view = "an integrity check" if check else "a stats report"
        return self._whole_cache_view(session, view, lambda: self.report(check)), []

    def report(self, check: bool = False) -> dict[str, Any]:
        """What STATS answers (the metrics' snapshot too, which no budget holds back)."""
        cache = self.cache
        # (before a daemon for engines has a layout, no pool yet: its figures are all 0)
        stats = CacheStats.zero() if cache is None else cache.stats()
        out: dict[str, Any] = self.tiers.fields(stats.as_dict())
        out.update(self.engine_counts.as_dict())
        if self.tiers.engine:  # the engines load from the pool themselves
            token_bytes = 0 if cache is None else cache.config.token_bytes
            out["load_tokens"] = self.engine_counts.loaded
            out["load_bytes"] = min(SATURATED, self.engine_counts.loaded * token_bytes)
        if cache is not None and cache.l3 is not None:
            out["l3"] = cache.l3.stats()
        if cache is not None:
            assert self.capacity is not None  # (made with the cache)
            out["transfer_seconds"] = {d: h.as_dict() for d, h in cache.transfer_seconds.items()}
            out["transfer_bytes"] = {d: h.as_dict() for d, h in cache.transfer_bytes.items()}
            out["capacity_points"] = self.capacity.points()  # (by tier already: CapacityFeed)
        out.update(self.requests.as_dict())
        listed = [
            {
                "id": s.id,
                "client": s.client,
                "pid": s.pid,  # as its hello said
                "peer_pid": process_pid(s.process),  # the kernel's (ipc; 0: none)
                "owned_pages": len(s.owned),
                "pinned_pages": s.pinned_pages,
                "locks": len(s.locks),
                "admin": s.admin,
                "lapsed": bool(s.release_at),
                "queried_tokens": s.queried_tokens,
                "hit_tokens": s.hit_tokens,
                **s.engine.as_dict(),
            }
            for s, _ in zip(self.sessions.holders(), range(MAX_SESSION_LIST), strict=False)
        ]
        quarantined = self.sessions.quarantined()
        out.update(
            sessions=len(self.sessions),
            sessions_quarantined=len(quarantined),
            leases_expired=self.sessions.leases_expired,
            quarantined_tokens=sum(len(s.owned) for s in quarantined)
            * (0 if cache is None else cache.page_size),
            boot_epoch=self.boot_epoch,
            version=__version__,
            protocol=PROTOCOL_VERSION,
            config=self.info.get("config", {}),
            uptime_s=round(self.clock() - self.started, 3),
            pid=os.getpid(),
            token_bytes=0 if cache is None else cache.config.token_bytes,
            device_tier=self.info.get("config", {}).get("device_tier", "daemon"),
            layout=self.info.get("layout"),
            endpoint=self.info.get("endpoint", ""),
            housekeep_errors=self.housekeep_errors,
            **self.transport.counters(),
            session_list=listed,
        )
        out["views_refused"] = self.views.refused
        out["match_parts"] = 0 if self.ops is None else self.ops.match_parts
        if check:
            try:
                self.check_integrity()
                out["integrity"] = "ok"
            except AssertionError as exc:
                out["integrity"] = f"BROKEN: {exc}"
        return out

    def _whole_cache_view(self, session: Session | None, view: str, run: Callable[[], Any]) -> Any:
        """``run()``, a walk of the whole cache or of every session, within the view budget
        unless ``session`` is admin (QUOTA_EXCEEDED while views that delayed others took their
        share)."""
        if session is not None and session.admin:
            return run()
        self.views.check(view)
        started = time.perf_counter()
        try:
            return run()
        finally:
            self.views.charge(time.perf_counter() - started, self.transport.others_waiting())

    def check_integrity(self) -> None:
        """The cache's invariants, plus the sessions' against it (``integrity.py``). Raises
        IntegrityError."""
        check_sessions(self.cache, self.sessions)

    def capacity_report(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        """Estimated hit ratios at other tier sizes, and what to buy (`hicache capacity`;
        within the view budget: it first feeds the estimate for up to a second)."""
        assert self.capacity is not None  # (_handle: an op past NO_CACHE_OPS has a cache)
        capacity, cache = self.capacity, self.cache
        assert cache is not None
        store = {} if cache.l3 is None else cache.l3.store.describe()
        disk = int(store.get("disk_slots", 0))  # (a disk not opened yet: 0 until its first use)
        return self._whole_cache_view(
            session, "a capacity report", lambda: capacity.report(disk)
        ), []

    def tree(self, session: Session, fields: dict, frames: Frames, call: Call) -> Result:
        """The tree's shape (``shape``: per namespace, the ``top`` heaviest shared prefixes),
        or its first ``max_nodes`` nodes (within the view budget: ``_whole_cache_view``)."""
        req = TreeRequest.read(fields)
        assert self.cache is not None  # (_handle: an op past NO_CACHE_OPS has a cache)
        cache, tiers = self.cache, self.tiers
        return self._whole_cache_view(session, "a tree view", lambda: tree_reply(cache, tiers, req))
