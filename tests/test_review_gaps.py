"""Gaps a review found in the daemon's and the client's tests: the per-session lock and load
limits, the heartbeat ending on an unknown session, floats and bools where ints are meant on
the wire, ``reconnect()`` after a lost lease, ``hicache-daemon --help``, freeing the padding
slot, and the heartbeat's own socket. Each test fails when what it checks breaks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading

import msgpack
import numpy as np
import pytest
import torch
import zmq

from hicache.client import DaemonError, HiCacheClient, LeaseLost, NotOwned
from hicache.errors import InvalidIndicesError
from hicache.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    HelloReply,
    MatchReply,
    Op,
    PingReply,
    Reply,
    Request,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    slots_frame,
)
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until


@pytest.fixture
def ep(tmp_path):
    return f"ipc://{tmp_path}/d.sock"


def snapshot(hc: HiCacheClient) -> tuple:
    """What a refused request must leave as it was: the pools, the tree, the counters, and what
    the session holds."""
    s = hc.stats()
    held = hc.holdings()
    keys = (
        "device_free_tokens",
        "device_cached_tokens",
        "device_owned_tokens",
        "device_protected_tokens",
        "host_cached_tokens",
        "tree_nodes",
        "insert_calls",
        "match_calls",
        "load_back_calls",
        "hit_device_tokens",
        "hit_host_tokens",
        "miss_tokens",
        "sessions",
        "inflight_transfers",
    )
    return (tuple(s[k] for k in keys), held.lock_ids, held.owned_slots.tolist())


def refused(code: ErrorCode, call) -> DaemonError:
    with pytest.raises(DaemonError) as err:
        call()
    assert err.value.code is code, err.value
    return err.value


# ---- 1. the per-session lock and load limits --------------------------------------------------
def test_the_lock_limit_answers_quota_exceeded_changes_nothing_and_the_session_goes_on(ep):
    proc = start_daemon(ep, "--session-max-locks", "2", "--session-max-loads", "1")
    try:
        with HiCacheClient(ep, name="locker") as hc, HiCacheClient(ep, name="other") as other:
            assert hc.info["limits"]["max_locks"] == 2  # the settings reach the daemon
            assert hc.info["limits"]["max_loads"] == 1
            seq, fresh = list(range(1, 17)), list(range(100, 108))
            hc.insert(seq, hc.alloc(16))
            first, second = hc.match_prefix(seq), hc.match_prefix(seq)  # the limit: 2 locks
            tail = hc.alloc(8)  # owned, for an insert_and_lock that must not happen
            before = snapshot(hc)
            assert len(before[1]) == 2
            for call in (
                lambda: hc.match_prefix(seq),
                lambda: hc.match_batch([seq]),
                lambda: hc.lock(first),
                lambda: hc.insert_and_lock(fresh, tail),
            ):
                err = refused(ErrorCode.QUOTA_EXCEEDED, call)
                assert "locks" in err.message
                assert snapshot(hc) == before  # no lock, no insert, no counter moved
            assert other.match_prefix(seq).device_hit_length == 16  # a limit per session
            assert hc.match_prefix(seq, lock=False).device_hit_length == 16  # no lock: fine
            hc.release(first)
            third = hc.match_prefix(seq)  # room again: the session works on
            assert third.device_hit_length == 16
            refused(ErrorCode.QUOTA_EXCEEDED, lambda: hc.match_prefix(seq))  # 2 again
            hc.release(second)
            done = hc.insert_and_lock(fresh, tail)
            assert done.prefix_len == 0 and done.match.device_hit_length == 8
            hc.release(third, done.match)
            assert hc.holdings().lock_ids == []
            assert hc.stats(check=True)["integrity"] == "ok"
    finally:
        stop_daemon(proc)


def test_the_load_limit_answers_quota_exceeded_and_changes_nothing():
    """Loads in flight, held there by a manual transfer engine (a live daemon's copies land
    whenever they like): the second load of a session with a limit of one is refused until the
    first one is acknowledged."""
    from hicache import HiCacheConfig, HiRadixCache
    from hicache.daemon.requests import Handlers
    from hicache.daemon.sessions import SessionLimits, SessionTable
    from hicache.transfers import ManualTransferEngine

    cfg = HiCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=2,
        page_size=4,
        device_tokens=64,
        host_tokens=256,
        load_back_threshold=0,
    )
    cache = HiRadixCache(cfg, transfer_engine=ManualTransferEngine)
    limits = SessionLimits.for_pool(cache.device_alloc.capacity_pages, max_loads=1)
    handlers = Handlers(cache, SessionTable(lease_s=600), boot_epoch=5, info={}, limits=limits)
    ids = iter(range(1, 1000))

    def call(op: Op, fields: dict, *frames, key: int = 0, epoch: int = 5) -> Reply:
        header, _ = handlers.handle(
            encode_request(Request(op, next(ids), key, epoch, fields)), [*frames]
        )
        return decode_reply(header)

    try:
        key = call(Op.HELLO, {"client": "loader", "pid": 1}, epoch=0).fields["session"]
        seqs = [np.arange(100, 116, dtype=np.int32), np.arange(200, 216, dtype=np.int32)]
        for seq in seqs:
            cache.insert(seq, cache.alloc(16))
        cache.engine.complete_all()  # the backups
        handlers.housekeep()
        assert cache.evict(64).freed == 32  # both prefixes now live on the host only
        locks = []
        for seq in seqs:
            reply = call(Op.MATCH, {"lengths": [16]}, seq.tobytes(), key=key)
            entry = MatchReply.read(reply.fields).results[0]
            assert (entry.device_len, entry.host_len) == (0, 16)
            locks.append(entry.lock_id)
        first = call(Op.LOAD_BACK, {"lock_id": locks[0], "wait": False}, key=key)
        assert first.status is ErrorCode.OK and first.fields["ticket"]  # in flight
        (session,) = handlers.sessions.holders()

        def state() -> tuple:
            locked = {lock_id: r.node for lock_id, r in session.locks.items()}
            return cache.stats(), cache.engine.queued(), locked, set(session.loads)

        before = state()
        second = call(Op.LOAD_BACK, {"lock_id": locks[1], "wait": False}, key=key)
        assert second.status is ErrorCode.QUOTA_EXCEEDED, second
        assert "loads in flight" in second.fields["message"]
        assert state() == before  # no copy queued, no page taken, the lock where it was
        cache.engine.complete_all()  # the first load lands and is acknowledged
        handlers.housekeep()
        again = call(Op.LOAD_BACK, {"lock_id": locks[1], "wait": True}, key=key)
        assert again.status is ErrorCode.OK and again.fields["loaded"] == 16
        assert call(Op.RELEASE, {"lock_ids": locks}, key=key).status is ErrorCode.OK
        handlers.check_integrity()
        assert cache.stats().device_protected_tokens == 0
    finally:
        cache.close()


# ---- 2. the heartbeat ends on an unknown session -------------------------------------------------
def raw(endpoint: str, op: Op, session: int, epoch: int, fields: dict, *frames) -> Reply:
    """One request with an explicit session and epoch, on a socket of its own."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart(
            [msgpack.packb([PROTOCOL_VERSION, int(op), 1, session, epoch, fields]), *frames]
        )
        assert sock.poll(10_000)
        return decode_reply(sock.recv_multipart()[0])
    finally:
        sock.close(linger=0)


def test_the_heartbeat_stops_when_the_daemon_no_longer_knows_the_session(ep):
    proc = start_daemon(ep, lease=1.5)
    try:
        with HiCacheClient(ep, name="watcher") as watcher:
            hc = HiCacheClient(ep, name="ended-elsewhere")  # heartbeats every half second
            beat = hc._link._beat
            assert beat is not None and beat.is_alive()
            slots = hc.alloc(8)
            # the session ends behind the client's back (as after a daemon-side goodbye)
            assert raw(ep, Op.GOODBYE, hc.session, hc.conn.epoch, {}).status is ErrorCode.OK
            wait_until(lambda: hc.lost is not None, what="the heartbeat to learn of it")
            assert isinstance(hc.lost, LeaseLost)  # (not an exception that killed the thread)
            assert hc.lost.code is ErrorCode.UNKNOWN_SESSION
            beat.join(timeout=10)
            assert not beat.is_alive()  # no more beats for a session that is gone
            with pytest.raises(LeaseLost):
                hc.free(slots)  # every later call says so, and sends nothing
            s = watcher.stats()
            assert s["sessions"] == 1 and s["device_owned_tokens"] == 0
            assert hc.reconnect() and hc.ping()["pong"]  # the documented way back
            assert watcher.stats()["sessions"] == 2
            hc.close()
    finally:
        stop_daemon(proc)


# ---- 3. floats and bools where ints are meant, on the raw wire --------------------------------
def test_floats_and_bools_where_ints_are_meant_get_bad_field_and_change_nothing(ep):
    proc = start_daemon(ep)
    try:
        with HiCacheClient(ep, name="typed", admin=True) as hc:
            seq = np.arange(1, 17, dtype=np.int32)
            hc.insert(seq, hc.alloc(16))
            m = hc.match_prefix(seq)  # lock 1: what a float 1.0 would name
            assert m.lock_id == 1
            mine = hc.alloc(8)
            before = snapshot(hc)
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.connect(ep)
            key, epoch = hc.session, hc.conn.epoch
            tokens = seq.tobytes()
            new_tokens = np.arange(500, 508, dtype=np.int32).tobytes()
            cases = [
                (Op.ALLOC, {"num_tokens": 4.0}),
                (Op.ALLOC, {"num_tokens": True}),
                (Op.LOCK, {"lock_id": 1.0}),
                (Op.LOCK, {"lock_id": True}),
                (Op.LOAD_BACK, {"lock_id": 1.0}),
                (Op.LOAD_BACK, {"lock_id": True}),
                (Op.LOAD_BACK, {"lock_id": 1, "wait": 0}),
                (Op.RELEASE, {"lock_ids": [1.0]}),
                (Op.RELEASE, {"all": 1}),
                (Op.TREE, {"max_nodes": 5.0}),
                (Op.EVICT, {"device_tokens": 16.0}),
                (Op.EVICT, {"host_tokens": True}),
                (Op.STATS, {"check": 1.0}),
                (Op.MATCH, {"lengths": [8.0, 8.0]}, tokens),
                (Op.MATCH, {"lengths": [16, 16], "shared": [0, 16.0]}, tokens),
                (Op.MATCH, {"lengths": [16], "lock": 1}, tokens),
                (Op.INSERT, {"lengths": [4.0, 4.0]}, new_tokens, bytes(slots_frame(mine))),
                (Op.INSERT, {"lengths": [8], "lock": 1}, new_tokens, bytes(slots_frame(mine))),
                (Op.HELLO, {"client": "x", "pid": 1.0}),
                (Op.HELLO, {"client": "x", "admin": 1}),
            ]
            for i, (op, fields, *frames) in enumerate(cases):
                header = msgpack.packb([PROTOCOL_VERSION, int(op), i + 1, key, epoch, fields])
                sock.send_multipart([header, *frames])
                assert sock.poll(10_000)
                reply = decode_reply(sock.recv_multipart()[0])
                assert reply.status is ErrorCode.BAD_FIELD, (op.name, fields, reply)
            for i, head in enumerate(  # the header's own ints: op, request id, session, epoch
                (
                    [PROTOCOL_VERSION, float(Op.ALLOC), 1, key, epoch, {"num_tokens": 4}],
                    [PROTOCOL_VERSION, int(Op.ALLOC), 1.0, key, epoch, {"num_tokens": 4}],
                    [PROTOCOL_VERSION, int(Op.ALLOC), 1, float(key), epoch, {"num_tokens": 4}],
                    [PROTOCOL_VERSION, int(Op.ALLOC), 1, key, float(epoch), {"num_tokens": 4}],
                    [PROTOCOL_VERSION, int(Op.ALLOC), True, key, epoch, {"num_tokens": 4}],
                )
            ):
                sock.send_multipart([msgpack.packb(head)])
                assert sock.poll(10_000)
                reply = decode_reply(sock.recv_multipart()[0])
                assert reply.status is ErrorCode.BAD_FIELD, (i, reply)
            sock.close(linger=0)
            assert snapshot(hc) == before
            hc.release(m)  # the session works on
            hc.free(mine)
            assert hc.stats(check=True)["integrity"] == "ok"
    finally:
        stop_daemon(proc)


@pytest.mark.parametrize(
    ("op", "lengths"),
    [(Op.MATCH, [16.0]), (Op.MATCH, [True]), (Op.INSERT, [8.0])],
    ids=["match-16.0", "match-True", "insert-8.0"],
)
def test_a_float_or_bool_length_of_one_sequence_gets_bad_field(ep, op, lengths):
    proc = start_daemon(ep)
    try:
        with HiCacheClient(ep, name="typed") as hc:
            seq = np.arange(1, 17, dtype=np.int32)
            hc.insert(seq, hc.alloc(16))
            mine = hc.alloc(8)
            before = snapshot(hc)
            if op is Op.MATCH:
                frames = [seq[: 1 if lengths == [True] else 16].tobytes()]
            else:
                frames = [np.arange(500, 508, dtype=np.int32).tobytes(), bytes(slots_frame(mine))]
            reply = raw(ep, op, hc.session, hc.conn.epoch, {"lengths": lengths}, *frames)
            changed = snapshot(hc) != before
            assert (reply.status, changed) == (ErrorCode.BAD_FIELD, False), reply
    finally:
        stop_daemon(proc)


# ---- 4. reconnect() after LeaseLost --------------------------------------------------------------
def test_reconnect_after_a_lost_lease_gives_a_working_session_and_the_old_one_is_gone(ep):
    proc = start_daemon(ep, lease=1.0, quarantine=0.5)
    try:
        with HiCacheClient(ep, name="watcher") as watcher:
            hc = HiCacheClient(ep, name="silent", heartbeat=False)  # nothing keeps its lease
            seq = list(range(1, 17))
            hc.insert(seq, hc.alloc(16))
            old_match = hc.match_prefix(seq)  # lock 1 of the old session
            old_slots = hc.alloc(8)
            assert old_match.lock_id == 1 and len(old_slots) == 8

            def only_the_watcher_is_left() -> bool:
                s = watcher.stats()
                return s["sessions"] == 1 and s["sessions_quarantined"] == 0

            wait_until(only_the_watcher_is_left, what="the lease and the quarantine to run out")
            s = watcher.stats(check=True)  # the old session's pages and lock were given back
            assert s["device_owned_tokens"] == 0 and s["device_protected_tokens"] == 0
            assert s["integrity"] == "ok"
            with pytest.raises(LeaseLost):
                hc.alloc(4)
            assert isinstance(hc.lost, LeaseLost)
            with pytest.raises(LeaseLost):  # sticky until reconnect
                hc.ping()
            assert hc.reconnect() is True
            assert hc.lost is None and hc.reconnect() is False  # nothing lost: nothing to do
            pools = hc.attach()
            with pytest.raises(NotOwned):  # the old session's slots are nobody's now
                hc.free(old_slots)
            m = hc.match_prefix(seq)  # the cache outlived the session; lock 1 again
            assert m.device_hit_length == 16 and m.lock_id == old_match.lock_id
            hc.release(old_match)  # void: skipped, so it cannot release the new lock 1
            assert hc.holdings().lock_ids == [m.lock_id]
            new = hc.alloc(8)
            pools.k_buffer[0][new] = 3.0
            assert hc.insert(list(range(200, 208)), new) == 0
            assert hc.match_prefix(list(range(200, 208)), lock=False).device_hit_length == 8
            hc.release(m)
            held = hc.holdings()
            assert held.lock_ids == [] and len(held.owned_slots) == 0
            # (a write-through backup locks the new node until its copy is acknowledged)
            wait_until(lambda: watcher.stats()["device_protected_tokens"] == 0, what="backups")
            s = watcher.stats(check=True)
            assert s["sessions"] == 2 and s["sessions_quarantined"] == 0
            assert s["device_owned_tokens"] == 0
            assert s["integrity"] == "ok"
            hc.close()
    finally:
        stop_daemon(proc)


# ---- 5. hicache-daemon --help -------------------------------------------------------------------
ENUMS = {
    "--dtype": ("float16", "bfloat16", "float32"),
    "--kv-format": ("mha", "mla"),
    "--host-layout": ("layer_first", "page_first", "page_first_direct"),
    "--transfer-backend": ("auto", "kernel", "direct", "cpu"),
    "--write-policy": ("write_through", "write_through_selective", "write_back"),
    "--eviction-policy": ("lru", "lfu", "fifo"),
}


def test_daemon_help_shows_every_setting_with_its_default_and_the_choices():
    from hicache.daemon.config import DAEMON_FIELDS, build_parser, resolve

    script = shutil.which("hicache-daemon", path=os.path.dirname(sys.executable))
    argv = [script] if script else [sys.executable, "-m", "hicache.daemon"]
    env = {**os.environ, "COLUMNS": "400"}  # one line per option
    env = {k: v for k, v in env.items() if not k.startswith("HICACHE_")}
    r = subprocess.run([*argv, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    text = " ".join(r.stdout.split())
    actions = [
        a
        for a in build_parser()._actions
        if a.option_strings
        and a.dest not in ("help", "config", "print_config", "log_json", "log_level")
    ]
    # each option's help: from its "--flag METAVAR" entry (after the usage) to the next one
    starts = {a.dest: text.rindex(f"{a.option_strings[0]} {a.metavar}") for a in actions}
    ends = sorted(starts.values()) + [len(text)]
    shown = {d: text[s : ends[ends.index(s) + 1]] for d, s in starts.items()}
    used = resolve(build_parser().parse_args([]), {}).as_dict()  # what the daemon really uses
    computed = {"endpoint", "quarantine_seconds"}  # resolved from other settings: in words
    assert {a.dest for a in actions} == set(used) - {
        "host_capacity_tokens",
        "transfer_backend_resolved",
    }
    assert set(DAEMON_FIELDS) <= set(shown)
    for dest, help_ in shown.items():
        if dest in computed or used[dest] is None:
            assert "default" in help_ or "None:" in help_, help_
        else:
            assert f"[default: {used[dest]}]" in help_, (dest, help_)
    for a in actions:
        choices = ENUMS.get(a.option_strings[0])
        if choices:
            assert f"(one of: {', '.join(choices)})" in shown[a.dest], shown[a.dest]
    # the embedded default of the issue, as a new user reads it
    for flag, value in (("dtype", "float32"), ("page_size", 16), ("device_tokens", 16384)):
        assert f"[default: {value}]" in shown[flag]
    # each field's help is its metadata, the one place it is written
    from hicache.config import HiCacheConfig
    from hicache.l3 import L3Config

    for f in dataclasses.fields(HiCacheConfig):
        assert f.metadata["help"] and f.metadata["help"] in shown[f.name], f.name
    for f in dataclasses.fields(L3Config):
        if f.name not in ("url", "options"):  # (--l3 itself; the stores' options apart)
            assert f.metadata["help"] and f.metadata["help"] in shown[f"l3_{f.name}"], f.name


# ---- 6. freeing the padding slot -----------------------------------------------------------------
def test_freeing_slot_zero_raises_not_owned_and_changes_nothing(ep):
    proc = start_daemon(ep)
    try:
        with HiCacheClient(ep, name="pad") as hc:
            pools = hc.attach()
            mine = hc.alloc(8)
            assert int(mine.min()) >= 4  # page 0 (slots 0..3) is never handed out
            pools.k_buffer[0][0] = 0.0
            before = snapshot(hc)
            for slots in (
                [0],
                torch.tensor([0, 1, 2, 3]),
                torch.tensor([3]),
                torch.cat([mine, torch.tensor([0])]),  # with slots it does own: none freed
            ):
                with pytest.raises(NotOwned) as err:
                    hc.free(slots)
                assert isinstance(err.value, InvalidIndicesError)
                assert err.value.code is ErrorCode.NOT_OWNED
                assert snapshot(hc) == before
            assert bool((pools.k_buffer[0][0] == 0.0).all())
            hc.free(mine)  # the session works on
            s = hc.stats(check=True)
            assert s["integrity"] == "ok" and s["device_owned_tokens"] == 0
    finally:
        stop_daemon(proc)


# ---- 7. the heartbeat's own socket ---------------------------------------------------------------
class HoldingDaemon:
    """A stand-in daemon on a ROUTER socket, served by a thread: answers every request at once
    but PING, whose reply it holds until ``answer_pings`` is set; records which socket (ZeroMQ
    identity) sent what."""

    EPOCH = 77

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.seen: list[tuple[Op, bytes]] = []  # (op, identity), in arrival order
        self.held: list[tuple[bytes, int]] = []  # pings not answered yet
        self.answer_pings = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def count(self, op: Op) -> int:
        return sum(1 for o, _ in list(self.seen) if o is op)

    def identities(self, op: Op) -> set[bytes]:
        return {who for o, who in list(self.seen) if o is op}

    def _reply(self, who: bytes, request_id: int, fields: dict) -> None:
        reply = encode_reply(Reply(ErrorCode.OK, request_id, self.EPOCH, fields))
        self.sock.send_multipart([who, reply])

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self.answer_pings.is_set():
                for who, request_id in self.held:
                    self._reply(who, request_id, PingReply(True, 42, "held").fields())
                self.held = []
            if not self.sock.poll(20):
                continue
            who, header, *_ = self.sock.recv_multipart()
            req = decode_request(header)
            self.seen.append((req.op, who))
            if req.op is Op.PING and not self.answer_pings.is_set():
                self.held.append((who, req.request_id))
            elif req.op is Op.HELLO:
                hello = HelloReply(12345, 1, 0.3, 0.3, {}, config={"page_size": 4})
                self._reply(who, req.request_id, hello.fields())
            else:
                self._reply(who, req.request_id, {})

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close(linger=0)
        self.ctx.term()


def test_the_heartbeat_beats_on_its_own_socket_while_a_call_waits(ep):
    fake = HoldingDaemon(ep)
    try:
        hc = HiCacheClient(ep, name="beats", timeout_s=30)  # beats every 0.1 s (lease 0.3)
        got: list = []
        caller = threading.Thread(target=lambda: got.append(hc.ping()))
        caller.start()
        wait_until(lambda: len(fake.held) == 1, what="the long call to arrive")
        heard = hc._link.heard
        beats = fake.count(Op.HEARTBEAT)
        # while the call waits for its reply, beats go on, are answered, and are heard
        wait_until(lambda: fake.count(Op.HEARTBEAT) >= beats + 3, what="beats during the call")
        wait_until(lambda: hc._link.heard > heard, what="a beat's reply to be heard")
        assert hc.lost is None and caller.is_alive() and not got
        calls = fake.identities(Op.PING) | fake.identities(Op.HELLO)
        assert len(calls) == 2  # each thread's own connection (hello: the main thread's)
        assert not fake.identities(Op.HEARTBEAT) & calls  # and one of the heartbeat's own
        fake.answer_pings.set()
        caller.join(30)
        assert got == [{"pong": True, "pid": 42, "state": "held"}]  # its own reply, not a beat's
        hc.close()
        assert fake.count(Op.GOODBYE) == 1
    finally:
        fake.close()
