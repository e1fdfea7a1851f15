"""Random interleavings of sessions against the daemon's handlers (the real wire format, no
sockets), with daemon restarts that leave stale clients behind, leases that lapse mid-work,
daemon pauses and stalled engines that write on into their pages.

A model predicts every reply's status from the service clock it drives: stale clients are
refused with EPOCH_MISMATCH and change nothing, lapsed sessions get LEASE_EXPIRED, and their
pages are never granted to anyone during the quarantine. Every device prefix a match returns
holds the KV written for its tokens. ``Handlers.check_integrity()`` (the cache's invariants and
the sessions' against it) runs after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache import HiCacheConfig, HiRadixCache
from hicache.daemon.requests import Handlers
from hicache.daemon.sessions import ServiceClock, SessionTable
from hicache.protocol import PROTOCOL_VERSION, ErrorCode, MatchReply, Op, decode_reply
from hicache.transfers import ManualTransferEngine
from tests.reach import run_until_reached
from tests.reference import expected_kv, read_kv, write_kv

PS = 2
# Time in whole milliseconds: integer arithmetic is exact, so the model and the daemon agree
# even on a lease that ends exactly now.
LEASE, QUARANTINE, MAX_GAP, TICK = 1000, 500, 200, 50


@dataclass
class Client:
    epoch: int  # the daemon life it belongs to
    session: int
    owned: list[np.ndarray] = field(default_factory=list)  # slot arrays it was granted
    locks: list[int] = field(default_factory=list)
    expires: int = 0  # the model's lease deadline (service time, ms)
    gone: bool = False  # said goodbye


class DaemonMachine(RuleBasedStateMachine):
    # what the runs reached (checked after them): allocations while a lapsed session's pages
    # are in quarantine, and quarantines that ran out with pages to give back
    seen = {"alloc_during_a_quarantine": 0, "quarantine_over": 0}

    def __init__(self) -> None:
        super().__init__()
        self.now = 0  # the fake monotonic source (ms)
        self.service = 0  # the model's service clock
        self.pending_gap = 0  # time since the daemon last read its clock
        self.epochs = iter(range(11, 10**6, 2))
        self.clients: list[Client] = []
        self.boot()

    # ---- the daemon ---------------------------------------------------------------------
    def boot(self) -> None:
        cfg = HiCacheConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            dtype="float32",
            page_size=PS,
            device_tokens=16 * PS,
            host_tokens=40 * PS,
            load_back_threshold=0,
        )
        self.cache = HiRadixCache(cfg, transfer_engine=ManualTransferEngine)
        self.cache.engine.auto = True
        clock = ServiceClock(MAX_GAP, source=lambda: self.now)
        sessions = SessionTable(LEASE, QUARANTINE)
        self.epoch = next(self.epochs)
        self.handlers = Handlers(self.cache, sessions, self.epoch, {}, clock=clock)
        self.pending_gap = 0
        self.last_housekeep = -1  # service time of the last housekeeping

    def read_clock(self) -> int:
        """What the daemon's service clock reads at its next reading."""
        self.service += min(self.pending_gap, MAX_GAP)
        self.pending_gap = 0.0
        return self.service

    def released(self, c: Client) -> bool:
        """Whether the daemon gave back what the lapsed session ``c`` held (at a housekeep)."""
        hk = self.last_housekeep
        return c.expires < hk and c.expires + QUARANTINE <= hk

    def expected(self, c: Client, op: Op, now: int) -> ErrorCode | None:
        """The status the model predicts (None: the op's own outcome)."""
        if c.epoch != self.epoch:
            return ErrorCode.EPOCH_MISMATCH
        if op is Op.GOODBYE:
            return ErrorCode.UNKNOWN_SESSION if self.released(c) else ErrorCode.OK
        return ErrorCode.LEASE_EXPIRED if c.expires < now else None

    def call(self, c: Client, op: Op, fields: dict, *frames) -> tuple:
        header = msgpack.packb([PROTOCOL_VERSION, int(op), 1, c.session, c.epoch, fields])
        now = self.read_clock()
        reply, out = self.handlers.handle(header, list(frames))
        decoded = decode_reply(reply)
        want = self.expected(c, op, now)
        if want is not None:
            assert decoded.status is want, (op, decoded)
        else:
            c.expires = now + LEASE
            assert decoded.status not in (
                ErrorCode.INTERNAL,
                ErrorCode.EPOCH_MISMATCH,
                ErrorCode.LEASE_EXPIRED,
            ), (op, decoded)
        return decoded, out

    def held_pages(self) -> set[int]:
        """Pages the model says are still some client's: granted to a client of this daemon
        life that neither said goodbye nor was given back (a lapsed one's quarantine is not
        over). Never granted to anyone else meanwhile."""
        return {
            p
            for c in self.clients
            if c.epoch == self.epoch and not c.gone and not self.released(c)
            for slots in c.owned
            for p in (slots // PS).tolist()
        }

    # ---- rules ----------------------------------------------------------------------------
    @rule()
    def hello(self) -> None:
        self._hello()

    def _hello(self) -> None:
        header = msgpack.packb([PROTOCOL_VERSION, int(Op.HELLO), 1, 0, 0, {"client": "e"}])
        now = self.read_clock()
        reply = decode_reply(self.handlers.handle(header, [])[0])
        assert reply.ok
        self.clients.append(Client(self.epoch, reply.fields["session"], expires=now + LEASE))

    def pick(self, data) -> Client:  # noqa: ANN001
        return data.draw(st.sampled_from([c for c in self.clients if not c.gone]))

    def live(self) -> bool:
        return any(not c.gone for c in self.clients)

    @rule(n=st.integers(1, 4 * PS))
    def engine_stalls_holding_pages(self, n) -> None:  # noqa: ANN001
        """An engine gets pages, then stops answering past its lease (a stuck step, a
        debugger): its pages go into quarantine, not back to the pool."""
        self._hello()
        self._alloc(self.clients[-1], n)
        self.run_quietly(25)

    @rule(n=st.integers(1, 8 * PS))
    def new_engine_allocates(self, n) -> None:  # noqa: ANN001
        """An engine starts (while others may have lapsed into quarantine) and asks for
        pages at once: none of the held ones may come back to it."""
        self._hello()
        self._alloc(self.clients[-1], n)

    @precondition(live)
    @rule(data=st.data(), n=st.integers(1, 3 * PS))
    def alloc(self, data, n) -> None:  # noqa: ANN001
        self._alloc(self.pick(data), n)

    def _alloc(self, c: Client, n: int) -> None:
        before = self.held_pages()
        in_quarantine = any(c.owned for c in self.stalled())
        reply, out = self.call(c, Op.ALLOC, {"num_tokens": n})
        if reply.ok:
            slots = np.frombuffer(bytes(out[0]), dtype=np.int64).copy()
            assert not set((slots // PS).tolist()) & before, "a held page was granted again"
            c.owned.append(slots)
            self.seen["alloc_during_a_quarantine"] += in_quarantine

    @precondition(live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3 * PS))
    def insert(self, data, tokens) -> None:  # noqa: ANN001
        """Write KV for ``tokens`` into a granted slot array, then insert it."""
        c = self.pick(data)
        match = [s for s in c.owned if len(s) >= len(tokens)]
        if not match:
            return
        slots = match[0][: len(tokens)]
        seq = np.array(tokens, np.int32)
        own_pool = c.epoch == self.epoch and not self.released(c)  # its pages are still its own
        if own_pool:  # (a stale engine writes into the old daemon's pool, not this one)
            write_kv(self.cache.device_pool, torch.from_numpy(slots), seq, 0, seq)
        fields = {"lengths": [len(seq)]}
        reply, _ = self.call(c, Op.INSERT, fields, seq.tobytes(), slots.tobytes())
        if reply.ok:  # the daemon owns the inserted pages; whole pages after them stay ours
            c.owned = [s for s in c.owned if s is not match[0]]
            rest = match[0][-(-len(tokens) // PS) * PS :]
            if len(rest):
                c.owned.append(rest)

    @precondition(live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=PS, max_size=4 * PS))
    def match(self, data, tokens) -> None:  # noqa: ANN001
        c = self.pick(data)
        seq = np.array(tokens, np.int32)
        reply, out = self.call(c, Op.MATCH, {"lengths": [len(seq)]}, seq.tobytes())
        if not reply.ok:
            return
        dev, _, lock_id, ids = MatchReply.read(reply.fields).results[0]
        pages = np.frombuffer(bytes(out[0]), dtype=np.int64)
        counts = np.cumsum([0, *reply.fields["chunk_pages"]])
        mine = np.concatenate([pages[counts[i] : counts[i + 1]] for i in ids] or [pages[:0]])
        slots = torch.from_numpy((mine[:, None] * PS + np.arange(PS)).reshape(-1))
        assert len(slots) == dev
        if dev:
            got = read_kv(self.cache.device_pool, slots)
            assert torch.equal(got, expected_kv(seq[:dev], 2, 1)), "another prefix's KV"
        if lock_id:
            c.locks.append(lock_id)

    @precondition(lambda self: any(c.locks and not c.gone for c in self.clients))
    @rule(data=st.data())
    def release(self, data) -> None:  # noqa: ANN001
        c = data.draw(st.sampled_from([c for c in self.clients if c.locks and not c.gone]))
        reply, _ = self.call(c, Op.RELEASE, {"lock_ids": c.locks})
        if reply.ok:
            c.locks = []

    @precondition(lambda self: any(c.owned and not c.gone for c in self.clients))
    @rule(data=st.data())
    def free(self, data) -> None:  # noqa: ANN001
        c = data.draw(st.sampled_from([c for c in self.clients if c.owned and not c.gone]))
        reply, _ = self.call(c, Op.FREE, {}, c.owned[0].tobytes())
        if reply.ok:
            c.owned.pop(0)

    @precondition(live)
    @rule(data=st.data())
    def heartbeat(self, data) -> None:  # noqa: ANN001
        self.call(self.pick(data), Op.HEARTBEAT, {})

    @precondition(live)
    @rule(data=st.data())
    def goodbye(self, data) -> None:  # noqa: ANN001
        c = self.pick(data)
        self.call(c, Op.GOODBYE, {})
        c.gone = True

    def stalled(self) -> list[Client]:
        """Clients the model says lapsed but whose quarantine is not over."""
        return [
            c
            for c in self.clients
            if c.epoch == self.epoch
            and not c.gone
            and c.expires < self.service
            and not self.released(c)
        ]

    @precondition(lambda self: self.stalled())
    @rule(data=st.data())
    def stalled_engine_writes_on(self, data) -> None:  # noqa: ANN001
        """A lapsed engine that was only stalled writes into its own pages: harmless while
        they are quarantined (nobody else may have been given them)."""
        c = data.draw(st.sampled_from(self.stalled()))
        for slots in c.owned:
            self.cache.device_pool.layers[:, :, torch.from_numpy(slots)] = -5.0

    @rule(steps=st.sampled_from([1, 5, 25, 45]))
    def quiet(self, steps) -> None:  # noqa: ANN001
        self.run_quietly(steps)

    def run_quietly(self, steps: int) -> None:
        """The daemon runs and housekeeps while nobody speaks: leases lapse (a lease is 20
        ticks), quarantines run out (10 more)."""
        for _ in range(steps):
            self.now += TICK
            self.pending_gap += TICK
            held = [c for c in self.stalled() if c.owned]
            self.last_housekeep = self.read_clock()
            self.handlers.housekeep()
            self.seen["quarantine_over"] += sum(self.released(c) for c in held)

    @rule(ms=st.integers(300, 30_000))
    def pause_daemon(self, ms) -> None:  # noqa: ANN001
        """SIGSTOP, a frozen VM: only MAX_GAP of it counts against the clients."""
        self.now += ms
        self.pending_gap += ms

    @rule()
    def restart_daemon(self) -> None:
        """A new daemon life; every client of the old one is stale now."""
        self.cache.close()
        self.boot()

    @invariant()
    def integrity(self) -> None:
        self.handlers.check_integrity()

    def teardown(self) -> None:
        self.cache.close()


def test_sessions_across_restarts_pauses_and_stalls() -> None:
    DaemonMachine.TestCase.settings = settings(
        max_examples=80,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    run_until_reached(DaemonMachine)
