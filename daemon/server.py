"""The daemon process: owns the cache and its shared pools, serves one ZeroMQ ROUTER socket.

One control loop: poll the socket with a timeout, hand each request to Handlers, send the
reply; between requests (and at least every HOUSEKEEP_S) process transfer acks and expire
sessions. Copies run on the transfer engine's own thread meanwhile. After a reply the loop
watches the socket for ``busy_poll_us`` before it sleeps on it (the next request of an engine
finds it awake) while requests come back that fast (``busy_poll.py``).

What is served next, who sent it and how replies leave (never blocking the loop) is the
inbox's (``inbox.py``).

Start-up claims the endpoint (no second daemon on one ipc path), binds, then creates the pools;
whatever fails, what was made so far is undone (no shared memory left behind).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import zmq

from hicache.cache import HiRadixCache
from hicache.config import HiCacheConfig
from hicache.curve import load_secret
from hicache.daemon.config import DaemonSettings
from hicache.daemon.keep import HostKeeper, InstanceLock, instance_token, remove_stale, segment_name
from hicache.daemon.keep import spawn as spawn_reaper
from hicache.daemon.observe import EventPublisher, GcPauses, MemoryTrim, MetricsServer
from hicache.daemon.requests import (
    IDLE_BUDGET_S,
    WAKE_ID,
    Call,
    EngineTier,
    Handlers,
    L3Waits,
    TierNames,
    Transport,
)
from hicache.daemon.sessions import SNDHWM, SessionLimits, SessionTable
from hicache.daemon.transport import (
    MAX_CONNECTIONS,
    AdminToken,
    BusyPoll,
    EndpointClaim,
    EndpointError,
    Inbox,
    WireWatch,
    bind_address,
    check_folder,
    connections_allowed,
    raise_descriptor_limit,
)
from hicache.endpoints import admin_token_path, is_loopback
from hicache.l3 import L3Tier, LazyStore
from hicache.memory import CudaBacking, EngineLayout, PageState, SharedMemoryBacking
from hicache.observe import TierEvents
from hicache.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION
from hicache.transfers import DEFAULT_CAPACITY as PROGRESS_CAPACITY
from hicache.transfers import LayerProgress

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("hicache.daemon")
RCVHWM = 64  # requests queued per peer before zmq stops reading from it (it waits, we don't)
HOUSEKEEP_S = 0.05  # acks and leases are looked at least this often
DEFER_AT_MOST_S = 1.0  # housekeeping's optional parts wait for others' requests at most this
POLL_MS = int(HOUSEKEEP_S * 1000)
METRICS_EVERY_S = 1.0  # how often the metrics snapshot is refreshed
DUMP_EVERY_S = 1.0  # KV event dumps are made at most this often (one serves every asker)


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)

__all__ = ["Daemon", "EndpointError", "bind_address"]


class Daemon:
    """Built by its constructor (each resource by a builder that registers its close on one
    ExitStack, so a failed start undoes exactly what it made), served by ``serve``, undone by
    ``close``: the keep-host decision, then the stack in reverse order of building."""

    def __init__(self, settings: DaemonSettings):
        self.settings = settings
        self.stopping = False
        self.draining = False  # SIGTERM: finishing up before stopping (see stop())
        self._next_dump = 0.0  # the earliest the next KV event dump is made
        self._trim = MemoryTrim()  # freed heap back to the system when quiet
        self.gc = GcPauses()  # the cycle collector's pauses (started by run())
        self._optional_ran = time.monotonic()  # housekeeping's optional parts last ran then
        self.drain_deadline = 0.0
        self._stack = contextlib.ExitStack()  # every close, in the order of building
        self.cache: HiRadixCache | None = None
        self.progress: SharedMemoryBacking | None = None  # the layer-progress table engines read
        self.waits: L3Waits | None = None  # matches waiting for the third tier
        self.metrics: MetricsServer | None = None  # /metrics over a snapshot (--metrics-port)
        self.events: EventPublisher | None = None  # KV events for routers (--events-endpoint)
        self.auth: ThreadAuthenticator | None = None  # CurveZMQ's ZAP handler thread (--curve-*)
        self.keeper: HostKeeper | None = None  # keeps the host tier across restarts
        self._adopt: str | None = None  # the last daemon's host segment to take over
        self._host: SharedMemoryBacking | None = None
        self._huge: dict[str, int] = {}  # {tier}_huge_page_bytes of each shared pool
        self._worth_keeping = False  # it served (or adopted a kept tier): a stop keeps it
        try:
            raise_descriptor_limit()  # (each tcp connection takes two: zmq's, the watch's copy)
            self._open_socket(settings)
            self._admin = self._closing(AdminToken(admin_token_path(settings.endpoint)))
            if settings.events_endpoint:
                self._open_events(settings)
            self._open_keeper(settings)
            self.boot_epoch = secrets.randbits(62) | 1  # never 0: 0 means "no epoch yet"
            info = {
                "boot_epoch": self.boot_epoch,
                "protocol": PROTOCOL_VERSION,
                "endpoint": settings.endpoint,
                "config": settings.as_dict(),
                "pools": None,  # device_tier=engine: none until an engine registers its layout
                "layout": None,
            }
            tier = EngineTier(settings, self._make_cache) if settings.engine_tier else None
            if tier is None:
                info["pools"] = self._make_cache(settings.config)[1]
            self.handlers = self._make_handlers(settings, info, tier)
            self._warn_plain_tcp(settings)
            if settings.metrics_port:
                self._open_metrics(settings)
        except BaseException:
            self.close()
            raise

    def _closing(self, resource: C) -> C:
        """``resource``, its ``close`` registered on the stack."""
        self._stack.callback(resource.close)
        return resource

    # ---- builders: each makes one resource and registers its close ---------------------------
    def _open_socket(self, settings: DaemonSettings) -> None:
        """The endpoint's claim, the ROUTER socket bound there (CurveZMQ when configured), what
        reads it (inbox, busy poll, the tcp connections' watch) and the third tier's wake."""
        self._closing(EndpointClaim(settings.endpoint))
        self.ctx = zmq.Context()
        self._stack.callback(self.ctx.term)  # (after every socket of it is closed)
        self.sock = sock = self.ctx.socket(zmq.ROUTER)
        self._stack.callback(sock.close, linger=0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)
        sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
        sock.setsockopt(zmq.SNDTIMEO, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)  # bounds what a peer that never reads pins
        sock.setsockopt(zmq.RCVHWM, RCVHWM)  # ... and what a flooding peer queues here
        self.busy = BusyPoll(sock, settings.busy_poll_us)
        watch = None
        if settings.endpoint.startswith("tcp://"):
            most = connections_allowed(0.5, MAX_CONNECTIONS)  # (events: a quarter each)
            watch = self._closing(WireWatch(sock, settings.curve, "control", max_connections=most))
        self.inbox = Inbox(sock, self.busy, WAKE_ID, watch)
        if settings.curve:
            self._secure(sock)
        self._bind(settings.endpoint)
        if settings.l3 is not None:
            wake = f"inproc://hicache-l3-wake-{os.getpid()}-{id(self)}"
            sock.bind(wake)
            self.waits = self._closing(L3Waits(self.ctx, wake))  # (closed after the IO thread)

    def _secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CurveZMQ server that lets in only the clients
        whose public keys are in --curve-clients (checked by a ZAP thread, started once)."""
        if self.auth is None:
            from zmq.auth.thread import ThreadAuthenticator

            self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("hicache.auth"))
            self.auth.start()
            self._stack.callback(self.auth.stop)
            assert self.settings.curve_clients is not None  # (settings: both or neither)
            self.auth.configure_curve(domain="*", location=self.settings.curve_clients)
        assert self.settings.curve_secret_key is not None  # (called under settings.curve)
        public, secret = load_secret(self.settings.curve_secret_key)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def _open_events(self, settings: DaemonSettings) -> None:
        """The KV event publisher (--events-endpoint) and its replay socket."""
        assert settings.events_endpoint is not None  # (called only with one)
        for ep in (settings.events_endpoint, settings.events_replay_endpoint):
            if ep and ep.startswith("ipc://"):  # the control socket's rule (endpoint.py)
                check_folder(os.path.dirname(os.path.abspath(ep[len("ipc://") :])))
        old = os.umask(0o177)  # ipc event sockets are born 0600, as the control socket
        try:
            self.events = self._closing(
                EventPublisher(
                    self.ctx,
                    bind_address(settings.events_endpoint),
                    settings.events_replay_endpoint
                    and bind_address(settings.events_replay_endpoint),
                    settings.events_topic,
                    settings.events_buffer,
                    self._secure if settings.curve else None,
                )
            )
        except zmq.ZMQError as exc:
            raise EndpointError(f"cannot publish KV events: {exc}") from None
        finally:
            os.umask(old)

    def _open_keeper(self, settings: DaemonSettings) -> None:
        """This instance's lock (taken before any segment exists) and the reaper that gives
        its pools back once it is gone, however it ends (daemon/keep/reaper.py); the host keeper
        and the last daemon's kept host pool to adopt; stale segments removed."""
        self._token = instance_token()
        lock = self._closing(InstanceLock(self._token))  # (closed after the segments are gone)
        self._reaper = spawn_reaper(lock.path, f"{os.getpid()}-{self._token}")
        l3 = settings.l3  # its model and shard say what the KV means: part of the snapshot's name
        model = None if l3 is None else f"{l3.model}#{l3.shard}"
        keeper = HostKeeper(
            settings.endpoint,
            self._token,
            settings.snapshot_seconds,
            model=model,
            grace_s=settings.keep_host_seconds,
        )
        if settings.keep_host and not settings.engine_tier and settings.config.host_enabled:
            self.keeper = keeper
            # the last daemon's host pool, renamed to ours before any clean-up judges it
            self._adopt = self.keeper.claim(settings.config)
        else:  # this daemon keeps nothing: what its endpoint's last daemon kept is freed
            keeper.discard_previous()
        removed = remove_stale()
        if removed:
            log.info("removed %d stale shared-memory segments", len(removed))

    def _make_handlers(
        self, settings: DaemonSettings, info: dict, tier: EngineTier | None
    ) -> Handlers:
        """The request handlers, with what the transport tells them."""
        inbox = self.inbox
        if settings.curve:  # (read only by a hello: a property costs a call per message)
            user = inbox.user
        elif settings.endpoint.startswith("tcp://"):  # no keys: the local user behind it
            user = inbox.local_user
        else:
            user = str
        transport = Transport(
            others_waiting=lambda: inbox.others_waiting(),
            user=user,
            process=inbox.process if settings.endpoint.startswith("ipc://") else str,
            counters=self._counters,
        )
        return Handlers(
            self.cache,
            SessionTable(settings.lease_seconds, settings.quarantine, settings.max_sessions),
            self.boot_epoch,
            info,
            limits=None if self.cache is None else self._limits(),
            admin_token=self._admin.value,
            engine_tier=tier,
            transport=transport,
        )

    def _warn_plain_tcp(self, settings: DaemonSettings) -> None:
        endpoints = (settings.endpoint, settings.events_endpoint, settings.events_replay_endpoint)
        plain = [e for e in endpoints if e and e.startswith("tcp://")]
        if plain and not settings.curve:
            log.warning(
                "%s without CurveZMQ (--insecure-local-tcp): every local user can connect, "
                "read cached prompts' token ids and insert KV",
                ", ".join(plain),
            )

    def _open_metrics(self, settings: DaemonSettings) -> None:
        """/metrics over a snapshot of the stats (--metrics-port)."""
        if not is_loopback(f"tcp://{settings.metrics_host}:0"):
            log.warning(
                "metrics on %s:%d can be read by anyone who reaches that address (no "
                "authentication): cache sizes, hit rates and client names",
                settings.metrics_host,
                settings.metrics_port,
            )
        try:
            self.metrics = self._closing(
                MetricsServer(settings.metrics_host, settings.metrics_port)
            )
        except OSError as exc:
            raise EndpointError(
                f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {exc}"
            ) from None
        self.metrics.publish(self._snapshot())

    def _make_cache(
        self, cfg: HiCacheConfig, layout: EngineLayout | None = None
    ) -> tuple[HiRadixCache, dict]:
        """Create the pools and the cache for ``cfg`` (at start, or when the first engine
        registers its ``layout``); returns the cache and the pools' description. A failure
        leaves nothing behind."""
        token = self._token
        device = (
            SharedMemoryBacking(segment_name("device", token))
            if cfg.device == "cpu"
            else CudaBacking(cfg.device)
        )
        host = (
            SharedMemoryBacking(segment_name("host", token), adopt=self._adopt)
            if cfg.host_enabled
            else None
        )
        self._adopt = None
        backings = [b for b in (device, host) if b is not None]
        self.progress = None
        try:
            self.cache = HiRadixCache(cfg, device, host)
            self._host = host
            names = TierNames(self.settings.engine_tier)  # (as every figure is reported)
            self._huge = {  # (fixed once mapped: reading smaps per request would cost)
                names.key(f"{tier}_huge_page_bytes"): pool.huge_page_bytes()
                for tier, pool in (("device", device), ("host", host))
                if isinstance(pool, SharedMemoryBacking)
            }
            self._hint_huge_pages(host or device, self._huge.get("host_huge_page_bytes"))
            if self.keeper is not None:
                assert host is not None  # (a keeper: there is a host tier)
                self._worth_keeping = self.keeper.restore(self.cache, host) > 0
            self.progress = self._share_progress(token)
            l3 = self.settings.l3
            if l3 is not None:
                store = LazyStore(l3.url, **l3.options)  # opened (and reopened) by its IO thread
                ident = None if layout is None else layout.identity()  # part of every key
                assert self.waits is not None  # (made in _start under settings.l3)
                tier = L3Tier(self.cache, l3, store, self.waits.wake, layout=ident)
                self.cache.attach_l3(tier)
                self.waits.counters = tier.counters  # (self.cache.l3's)
            if self.events is not None:  # an engine-owned device tier is this host pool
                device_medium = "CPU" if self.settings.engine_tier else "GPU"
                self.cache.attach_events(TierEvents(cfg.page_size, device_medium))
        except BaseException:
            self.cache = None
            for backing in (*backings, self.progress):
                if backing is not None:
                    backing.close()
            self.progress = None
            raise
        for backing in (*backings, self.progress):  # (closed after the cache)
            if backing is not None:
                self._stack.callback(backing.close)
        self._stack.callback(self._close_cache)
        return self.cache, {
            "device": device.describe(),
            "host": host.describe() if host else None,
            "progress": None
            if self.progress is None
            else {**self.progress.describe(), "capacity": PROGRESS_CAPACITY},
        }

    def _hint_huge_pages(self, pool: object, huge: int | None) -> None:
        """With a disk tier, say at start whether the pool its direct I/O reads into is on
        huge pages, and how to get them (1.7x-2x faster reads measured: docs/disk-tier.md)."""
        l3 = self.settings.l3
        if l3 is None or not (l3.url.startswith("disk://") or "disk" in l3.options):
            return
        if not isinstance(pool, SharedMemoryBacking) or not pool.nbytes or huge is None:
            return
        if huge * 2 >= pool.nbytes:
            log.info("disk: the pool is on huge pages (%.0f%%)", 100 * huge / pool.nbytes)
            return
        log.info(
            "disk: the pool %s is on 4 KiB pages: direct I/O moves each page of KV in 4 KiB "
            "pieces; `mount -o remount,huge=within_size %s` (before the daemon starts) puts "
            "pools on huge pages, and disk reads ran 1.7x-2x faster so (docs/disk-tier.md)",
            pool.path,
            os.path.dirname(pool.path),
        )

    def _limits(self) -> SessionLimits:
        assert self.cache is not None  # (made once there is a cache)
        settings = self.settings
        limits = SessionLimits.for_pool(
            self.cache.device_capacity_pages,
            settings.session_owned_fraction,
            settings.session_max_locks,
            settings.session_max_loads,
        )
        return limits

    def _counters(self) -> dict[str, float]:
        out: dict[str, float] = {"replies_dropped": self.inbox.dropped}
        out["busy_poll_watches"] = self.busy.watches
        out["busy_poll_hits"] = self.busy.found
        out["connections_closed"] = self.inbox.watch.closed if self.inbox.watch else 0
        out.update(self.gc.counters())
        out.update(self._huge)
        if self.events is not None:
            out["connections_closed"] += self.events.connections_closed()
        if self.events is not None:
            out["event_batches_published"] = self.events.published_batches
            out["event_batches_dropped"] = self.events.dropped_batches
        return out

    def _publish_events(self, housekeeping: bool = False) -> None:
        """Announce the tier changes since the last call. At housekeeping, answer the dump
        requests waiting (all with one dump, at most one dump per DUMP_EVERY_S: a flood of
        requests costs the loop no more than that)."""
        pub, tier = self.events, None if self.cache is None else self.cache.events
        assert pub is not None  # (called with --events-endpoint only)
        if tier is not None:
            events = tier.take()
            if events:
                pub.publish(events)
        if housekeeping and pub.dumps_wanted and time.monotonic() >= self._next_dump:
            peers: dict[bytes, None] = {}  # (an ordered set)
            while pub.dumps_wanted:
                peers[pub.dumps_wanted.popleft()] = None
            dump = []
            if tier is not None:
                assert self.cache is not None  # (the tier's)
                dump = tier.dump(self.cache.nodes())
            pub.send_dump(list(peers), dump)  # (no cache yet: nothing held, just the end)
            self._next_dump = time.monotonic() + DUMP_EVERY_S

    def _share_progress(self, token: str) -> SharedMemoryBacking | None:
        """The layer-progress table engines read to wait for single layers of a load."""
        assert self.cache is not None  # (_make_cache: just made)
        if not self.cache.config.host_enabled:  # (no host tier: no loads)
            return None
        backing = self.progress = SharedMemoryBacking(segment_name("progress", token))
        words = backing.allocate(PROGRESS_CAPACITY * 8, "layer progress").numpy().view(np.int64)
        self.cache.share_progress(LayerProgress(words, self.cache.config.num_layers))
        return backing

    def _bind(self, endpoint: str) -> None:
        assert self.sock is not None  # (_start: made first)
        old = os.umask(0o177)  # an ipc socket file is born 0600: no window for other users
        try:
            self.sock.bind(bind_address(endpoint))
        except zmq.ZMQError as exc:
            raise EndpointError(f"cannot listen on {endpoint}: {exc}") from None
        finally:
            os.umask(old)

    def _snapshot(self) -> dict:
        """The stats a scrape shows (made on the control thread: the cache is not shared)."""
        return self.handlers.report()

    def serve(self) -> None:
        """Serve until stop() (or a signal) sets ``stopping``."""
        self._worth_keeping = True
        next_housekeep = next_metrics = time.monotonic()
        busy = self.busy
        while not self.stopping:
            frames = self.inbox.next()
            if frames is None:  # quiet: nobody waits for the loop
                if self.handlers.capacity is not None:
                    self.handlers.capacity.run(IDLE_BUDGET_S)
                self._trim.maybe()
            if self.inbox.woken:  # a wake of the third tier read on the way
                self.inbox.woken = False
                self._resume()
            if frames:
                if frames[0] == WAKE_ID:  # the third tier finished something
                    self._resume()
                else:
                    busy.request()
                    self._serve_one(frames)
                    busy.replied_now()
                if self.events is not None:
                    self._publish_events()
            if time.monotonic() >= next_housekeep:
                self._housekeep()
                if self.events is not None:
                    self._publish_events(housekeeping=True)
                next_housekeep = time.monotonic() + HOUSEKEEP_S
                if self.metrics is not None:
                    self.metrics.beat(self.draining)
                    if next_housekeep >= next_metrics:
                        self.metrics.publish(self._snapshot())
                        next_metrics = next_housekeep + METRICS_EVERY_S
                if self.draining and self._drained():
                    return
                if self.keeper is not None and self.cache is not None:
                    self._periodic_snapshot()

    def _housekeep(self) -> None:
        """Acks, leases, answers the third tier allows; and, unless another client's request
        waits (it goes first), a slice of the capacity feed and giving memory back. Under a
        heavy client, these two met a waiting request in a third of the slowest 2% of
        another client's requests (0.37 ms each pass). They wait at most DEFER_AT_MOST_S:
        engines that always keep a request waiting (two busy ones) still get them."""
        now = time.monotonic()
        waiting = now < self._optional_ran + DEFER_AT_MOST_S and self.inbox.others_waiting(False)
        self.handlers.housekeep(estimate=not waiting)
        self._resume()
        if not waiting:
            self._optional_ran = now
            self._trim.maybe()  # (every TRIM_EVERY_S at most)

    def _resume(self) -> None:
        """Answer matches that waited for the third tier and may go on now."""
        waits = self.waits
        if waits is None or not waits.parked:
            return
        if self.cache is not None:
            self.cache.poll()
            if self.cache.l3 is not None:
                self.cache.l3.poll()
        waits.resume(self._handle_resumed, self.inbox.send)

    def _handle_resumed(
        self, identity: bytes, header: bytes | memoryview, frames: list
    ) -> tuple[bytes, list]:
        self.inbox.serving = identity  # (its turn is its own)
        reply, out = self.handlers.handle(header, frames, Call(identity, may_wait=False))
        return reply, out  # type: ignore[return-value]  # a resumed match is never deferred

    def _serve_one(self, frames: list[bytes | memoryview]) -> None:
        identity, rest = frames[0], frames[1:]
        if len(rest) > 1 and len(rest[0]) == 0:  # a REQ peer adds an empty delimiter
            rest = rest[1:]
        header = rest[0] if rest else b""
        waits = self.waits
        may_wait = waits is not None and waits.room() and not self.draining
        peer = self.inbox.serving = bytes(identity)  # (a resumed match ran)
        reply, out = self.handlers.handle(header, rest[1:], Call(peer, may_wait))
        if reply is None:  # a match that waits for the third tier
            assert waits is not None  # (may_wait: there is one)
            waits.park(identity, header, rest[1:], out)  # type: ignore[arg-type]  # a Deferred
            return
        self.inbox.send([identity, reply, *out])  # type: ignore[misc]  # a reply: its frames

    def stop(self, *_: object) -> None:
        """Stop at once (a signal handler's target when there is no drain)."""
        self.stopping = True

    def drain(self, *_: object) -> None:
        """SIGTERM: go not-ready, refuse new sessions (DRAINING), tell sessions in heartbeat
        replies, serve on until no live session holds pages or locks and no copy is in flight,
        or ``shutdown_timeout`` passes; then serve() returns and close() finishes copies. A
        second SIGTERM stops at once."""
        if self.draining or self.settings.shutdown_timeout <= 0:
            self.stopping = True
            return
        self.draining = self.handlers.draining = True
        self.drain_deadline = time.monotonic() + self.settings.shutdown_timeout
        if self.waits is not None:  # matches waiting for the third tier: answered now
            self.waits.expire_all()
        log.info(
            "draining: new sessions refused, exit within %.1f s", self.settings.shutdown_timeout
        )

    def _drained(self) -> bool:
        busy = [s for s in self.handlers.sessions if s.owned or s.locks]
        copies = 0 if self.cache is None else len(self.cache.records)
        parked = self.waits is not None and self.waits.parked  # (answered by the next pass)
        if not busy and not copies and not parked:
            log.info("drained: no session holds pages or locks, no copy in flight")
            return True
        if time.monotonic() >= self.drain_deadline:
            log.warning(
                "shutdown timeout: %d sessions still hold pages or locks, %d copies in flight",
                len(busy),
                copies,
            )
            return True
        return False

    def _periodic_snapshot(self) -> None:
        """Start a periodic host snapshot when due; finish one whose sums are in. Never fatal."""
        try:
            assert self.keeper is not None and self.cache is not None  # (serve: both)
            assert self._host is not None  # (a keeper: there is a host tier)
            self.keeper.poll(self.cache, self._host)
            if self.keeper.due():
                self.keeper.start(self.cache, self._host)
        except Exception:
            log.exception("host snapshot failed")

    def _keep_snapshot(self) -> bool:
        """Write the host snapshot (never fatal: a failure only costs the next daemon a cold
        start)."""
        try:
            assert self.keeper is not None and self.cache is not None  # (close: both)
            assert self._host is not None  # (a keeper: there is a host tier)
            self.keeper.write(self.cache, self._host)
            return True
        except Exception:
            log.exception("host snapshot failed")
            return False

    def close(self) -> None:
        """Refuse new work, finish in-flight copies, free the pools, remove the socket: the
        keep-host decision, then every close on the stack (last built, first closed). Undoes
        whatever a start made, however far it got; safe to call twice."""
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.close(self.cache)  # nothing reads the host pool behind our back from here
        if keeper is not None and self._worth_keeping and self.cache is not None:
            self.keeper = keeper
            # (a keeper: there is a host tier, its engine and its backing)
            assert self._host is not None
            self.cache.settle()  # the host copies are whole
            self.cache.poll()
            if not self.cache.count_pages(PageState.TREE, "host"):  # an empty tier: nothing to keep
                keeper.forget()
                keeper.discard_previous()  # (the snapshot file, if an earlier one is there)
            elif self._keep_snapshot():
                self._host.keep = True  # left for the next daemon (its marker says so)
                until = time.time() + self.settings.keep_host_seconds
                log.info(
                    "host tier kept for the next daemon on %s: %.2f GiB in %s until %s (then "
                    "freed; `hicache kept --free` frees it now)",
                    self.settings.endpoint,
                    self._host.nbytes / 2**30,
                    self._host.path,
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(until)),
                )
            self.keeper = None
        elif keeper is not None:  # nothing worth keeping: no marker either
            keeper.forget()
        self.gc.stop()
        self._stack.close()

    def _close_cache(self) -> None:
        """Wait for copies (they may still publish progress), stop the third tier's IO thread."""
        if self.cache is not None:
            self.cache.close()
            self.cache = None
