"""Hostile timing against a live daemon: restarts under attached clients, a daemon paused past
the lease, engines stalled past it, a daemon that dies mid-load, requests that time out.

Each test reproduces a defect the daemon had (see the issue's numbered items) and fails
without its fix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from hicache.client import DaemonError, DaemonTimeout, EpochChanged, HiCacheClient, LeaseLost
from hicache.client.results import LoadTicket
from hicache.protocol import PROTOCOL_VERSION, ErrorCode, Op, decode_reply, slots_frame
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until


@pytest.fixture
def ep(tmp_path):
    return f"ipc://{tmp_path}/d.sock"


def raw(endpoint: str, op: Op, session: int, epoch: int, fields: dict, *frames) -> ErrorCode:
    """One request with an explicit session and epoch, as a stale client would send it."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        header = msgpack.packb([PROTOCOL_VERSION, int(op), 1, session, epoch, fields])
        sock.send_multipart([header, *frames])
        assert sock.poll(10_000)
        return decode_reply(sock.recv_multipart()[0]).status
    finally:
        sock.close(linger=0)


def held(stats: dict) -> tuple:
    return tuple(
        stats[k]
        for k in (
            "device_cached_tokens",
            "device_owned_tokens",
            "device_protected_tokens",
            "tree_nodes",
            "insert_calls",
            "match_calls",
        )
    )


# ---- item 1: requests from another daemon life, or from a peer posing as a session --------
def test_a_restarted_daemon_refuses_an_old_clients_requests_before_running_them(ep):
    proc = start_daemon(ep)
    try:
        old = HiCacheClient(ep, name="old")  # heartbeats in the background
        old_tokens = list(range(1000, 1016))
        old_slots = old.alloc(16)
        old.insert(list(range(16)), old.alloc(16))
        old_lock = old.match_prefix(list(range(16)))  # (a match that found pages: locked)
        old_epoch, old_session = old.conn.epoch, old.session
        stop_daemon(proc)
        proc = start_daemon(ep)
        new = HiCacheClient(ep, name="new")
        pools = new.attach()
        assert new.info["session_id"] == old.info["session_id"]  # public ids restart
        fresh = new.alloc(16)
        assert torch.equal(fresh, old_slots)  # the very same pages, too
        pools.k_buffer[0][fresh] = 5.0
        new_tokens = list(range(5000, 5016))
        new.insert(new_tokens, fresh)
        mine = new.match_prefix(new_tokens)  # lock id 1, like the old client's
        before = held(new.stats())
        # every kind of request from the old life is refused before it runs
        ops = [
            (
                Op.INSERT,
                {"lengths": [16]},
                np.array(old_tokens, np.int32).tobytes(),
                bytes(slots_frame(old_slots)),
            ),
            (Op.RELEASE, {"lock_ids": [old_lock.lock_id]}),
            (Op.FREE, {}, bytes(slots_frame(fresh))),
            (Op.LOCK, {"lock_id": 1}),
            (Op.LOAD_BACK, {"lock_id": 1}),
            (Op.ALLOC, {"num_tokens": 4}),
            (Op.HEARTBEAT, {}),
            (Op.GOODBYE, {}),
            (Op.MATCH, {"lengths": [16]}, np.array(new_tokens, np.int32).tobytes()),
        ]
        for op, fields, *frames in ops:  # even were the old key the new one's, by chance
            for key in (old_session, new.session):
                status = raw(ep, op, key, old_epoch, fields, *frames)
                assert status is ErrorCode.EPOCH_MISMATCH
        assert held(new.stats()) == before
        with pytest.raises(EpochChanged):  # through the client: the same refusal
            old.insert(old_tokens, old_slots)
        with pytest.raises(EpochChanged):  # and it sticks: no request is even sent
            old.release(old_lock)
        wait_until(lambda: not old._link._beat.is_alive(), what="the stale heartbeat to stop")
        old.close()  # its goodbye cannot end the new session
        assert held(new.stats()) == before
        assert new.stats()["sessions"] == 1 and new.ping()["pong"]
        with HiCacheClient(ep, name="third") as third:
            assert third.match_prefix(old_tokens, lock=False).device_hit_length == 0
        assert torch.equal(pools.k_buffer[0][mine.device_indices], torch.full((16, 2, 4), 5.0))
        new.release(mine)
        assert new.stats(check=True)["integrity"] == "ok"
        new.close()
    finally:
        stop_daemon(proc)


# ---- item 3: a daemon paused past the lease ---------------------------------------------------
def test_a_paused_daemon_keeps_the_sessions_that_kept_beating(ep):
    proc = start_daemon(ep, lease=1.5, quarantine=0)
    try:
        clients = [HiCacheClient(ep, name=f"e{i}") for i in range(3)]
        seq = list(range(64))
        clients[0].insert(seq, clients[0].alloc(64))
        matches = [c.match_prefix(seq) for c in clients]
        owned = [c.alloc(8) for c in clients]
        os.kill(proc.pid, signal.SIGSTOP)  # two leases without running: heartbeats queue up
        time.sleep(3.0)
        os.kill(proc.pid, signal.SIGCONT)
        for c, m, slots in zip(clients, matches, owned, strict=True):
            c.release(m)  # the lease survived: no LeaseLost
            c.free(slots)
        s = clients[0].stats(check=True)
        assert s["sessions"] == 3 and s["sessions_quarantined"] == 0
        assert s["integrity"] == "ok" and s["device_owned_tokens"] == 0
        for c in clients:
            c.close()
    finally:
        stop_daemon(proc)


# ---- item 4: an engine stalled past its lease -------------------------------------------------
def test_a_stalled_engines_pages_are_quarantined_and_it_is_told(ep):
    proc = start_daemon(ep, lease=1.0, quarantine=60)
    try:
        stalled = HiCacheClient(ep, name="stalled", heartbeat=False)  # sends nothing more
        pools = stalled.attach()
        mine = stalled.alloc(96)
        victim = HiCacheClient(ep, name="victim")
        wait_until(lambda: victim.stats()["sessions_quarantined"] == 1, what="the lease lapse")
        got = []
        with pytest.raises(DaemonError) as err:
            while True:  # take everything there is
                got.append(victim.alloc(16))
        assert err.value.code is ErrorCode.OUT_OF_MEMORY
        assert "stalled, lapsed" in err.value.message  # the text names what holds the pool
        taken = torch.cat(got)
        assert not set(taken.tolist()) & set(mine.tolist())  # never the stalled engine's pages
        pools.k_buffer[0][taken] = 1.0
        pools.k_buffer[0][mine] = 9.0  # it resumes and writes on: into its own pages only
        assert bool((pools.k_buffer[0][taken] == 1.0).all())
        with pytest.raises(LeaseLost):
            stalled.insert(list(range(96)), mine)  # garbage never becomes cached KV
        with pytest.raises(LeaseLost):
            stalled.alloc(4)  # every later call says so
        assert victim.stats()["insert_calls"] == 0
        stalled.close()  # its goodbye ends the quarantine early
        s = victim.stats(check=True)
        assert s["sessions_quarantined"] == 0 and s["integrity"] == "ok"
        assert s["device_owned_tokens"] == len(taken)
        victim.close()
    finally:
        stop_daemon(proc)


STALLED_CHILD = """
import sys, time
from hicache.client import HiCacheClient
hc = HiCacheClient(sys.argv[1], name="stops")
hc.alloc(8)
print("ready", flush=True)
sys.stdin.readline()  # after SIGSTOP and SIGCONT
deadline = time.monotonic() + 20
while hc.lost is None and time.monotonic() < deadline:  # the heartbeat learns of it
    time.sleep(0.01)
try:
    hc.alloc(4)
    print("alloc worked", flush=True)
except Exception as exc:
    print(type(exc).__name__, flush=True)
hc.close()
"""


def test_the_heartbeat_tells_a_stalled_engine_its_lease_is_lost(ep):
    proc = start_daemon(ep, lease=1.0, quarantine=60)
    child = subprocess.Popen(
        [sys.executable, "-c", STALLED_CHILD, ep],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with HiCacheClient(ep, name="watcher") as watcher:
            child.send_signal(signal.SIGSTOP)
            wait_until(lambda: watcher.stats()["sessions_quarantined"] == 1, what="the lapse")
            child.send_signal(signal.SIGCONT)
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "LeaseLost"
            assert child.wait(timeout=30) == 0
            wait_until(lambda: watcher.stats()["sessions_quarantined"] == 0, what="goodbye")
    finally:
        child.kill()
        stop_daemon(proc)


# ---- item 8: waits for a load when the daemon dies or restarts --------------------------------
@pytest.mark.parametrize("heartbeat", [True, False])
def test_a_wait_for_a_layer_ends_when_the_daemon_dies(ep, heartbeat):
    proc = start_daemon(ep, lease=1.0)
    hc = HiCacheClient(ep, name="waits", heartbeat=heartbeat)
    hc._progress()  # the shared progress table is mapped, as during a real load
    never = LoadTicket(torch.empty(0, dtype=torch.int64), 10**6, 2)  # a load that never lands
    proc.kill()
    proc.wait()
    start = time.monotonic()
    with pytest.raises(DaemonTimeout):
        hc.wait_load(never)
    assert time.monotonic() - start < 10  # about a lease, not for ever
    hc.close()


def test_a_wait_for_a_layer_ends_when_the_daemon_restarts(ep):
    proc = start_daemon(ep, lease=1.0)
    hc = HiCacheClient(ep, name="waits", heartbeat=False)
    hc._progress()
    never = LoadTicket(torch.empty(0, dtype=torch.int64), 10**6, 2)
    proc.kill()
    proc.wait()
    proc = start_daemon(ep, lease=1.0)  # a new life on the same endpoint
    try:
        with pytest.raises(EpochChanged):
            hc.wait_load(never)
        hc.close()
    finally:
        stop_daemon(proc)


# ---- item 9: a request that timed out still ran ------------------------------------------------
def set_timeout(hc: HiCacheClient, seconds: float) -> None:
    hc.conn.timeout_ms = int(seconds * 1000)


def test_what_a_timed_out_request_brought_is_given_back(ep):
    proc = start_daemon(ep)
    try:
        seq = list(range(64))
        with HiCacheClient(ep, name="owner") as owner:
            owner.insert(seq, owner.alloc(64))
        hc = HiCacheClient(ep, name="impatient")
        set_timeout(hc, 0.2)
        os.kill(proc.pid, signal.SIGSTOP)  # busy: both requests time out, then both run
        try:
            for call in (lambda: hc.match_prefix(seq), lambda: hc.alloc(40)):
                with pytest.raises(DaemonTimeout):
                    call()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        set_timeout(hc, 30)
        hc.ping()  # the late replies (a lock, 40 slots) arrive first and are noted
        s = hc.stats()  # and given back before this request
        me = next(x for x in s["session_list"] if x["client"] == "impatient")
        assert (me["locks"], me["owned_pages"]) == (0, 0)
        assert s["device_protected_tokens"] == 0 and s["device_owned_tokens"] == 0
        hc.close()
    finally:
        stop_daemon(proc)


def test_a_peer_cannot_pose_as_another_session_nor_open_an_admin_one(ep):
    proc = start_daemon(ep)
    try:
        victim = HiCacheClient(ep, name="victim")
        victim.alloc(8)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(ep)
        sock.send_multipart([msgpack.packb([PROTOCOL_VERSION, int(Op.STATS), 1, 0, 0, {}])])
        head = decode_reply(sock.recv_multipart()[0])  # what anyone can read
        public = head.fields["session_list"][0]["id"]
        for key in (public, public + 1, 1):  # the public id names no session on the wire
            for op in (Op.GOODBYE, Op.FREE, Op.RELEASE, Op.HEARTBEAT):
                status = raw(ep, op, key, head.boot_epoch, {"lock_ids": [1]}, b"")
                assert status is ErrorCode.UNKNOWN_SESSION
        hello = {"client": "x", "admin": True}
        sock.send_multipart([msgpack.packb([PROTOCOL_VERSION, int(Op.HELLO), 2, 0, 0, hello])])
        assert decode_reply(sock.recv_multipart()[0]).status is ErrorCode.FORBIDDEN
        sock.close(linger=0)
        s = victim.stats()
        assert s["sessions"] == 1 and s["device_owned_tokens"] == 8
        with HiCacheClient(ep, name="ops", admin=True) as ops:  # the daemon's user can
            assert "device_freed" in ops.flush()
        victim.close()
    finally:
        stop_daemon(proc)


def test_a_late_alloc_decode_gives_back_only_the_page_it_started(ep):
    proc = start_daemon(ep, "--session-owned-fraction", "1")
    try:
        a = HiCacheClient(ep, name="a")
        pools = a.attach()
        first = a.alloc(1)  # token 0 of a request (page 1, offset 0)
        pools.k_buffer[0][first] = 1.0
        set_timeout(a, 0.2)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DaemonTimeout):
                a.alloc_decode([2], first)  # token 1: the next slot of the same page
            with pytest.raises(DaemonTimeout):
                a.alloc_extend([2], [6], first + 1)  # tokens 2..5: the page's rest, a new page
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        set_timeout(a, 30)
        a.ping()
        s = a.stats()  # the late replies' new page is given back, the request's page is not
        me = next(x for x in s["session_list"] if x["client"] == "a")
        assert me["owned_pages"] == 1
        with HiCacheClient(ep, name="b") as b:
            got = b.alloc(s["device_free_tokens"])
            assert int(first[0]) not in got.tolist()
            pools.k_buffer[0][got] = 2.0
        assert float(pools.k_buffer[0][first].flatten()[0]) == 1.0
        assert torch.equal(a.alloc_decode([2], first), first + 1)  # the request goes on
        a.close()
    finally:
        stop_daemon(proc)


def test_a_wait_after_the_daemon_stopped_is_a_timeout_not_a_missing_file(ep):
    proc = start_daemon(ep, lease=1.0)
    hc = HiCacheClient(ep, name="waits", heartbeat=False)
    stop_daemon(proc)  # its progress table is gone before the client ever mapped it
    never = LoadTicket(torch.empty(0, dtype=torch.int64), 10**6, 2)
    with pytest.raises(DaemonTimeout):
        hc.wait_load(never)
    hc.close()
