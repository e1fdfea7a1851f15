"""What the daemon refuses and survives: slots past a page, peers that never read, hostile
values, a second daemon, squatted folders, failed starts, huge replies, one session hogging the
pool, and the loser of a concurrent insert. Each test fails without its fix.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zmq

from hicache.client import DaemonError, HiCacheClient, NotOwned
from hicache.protocol import MAX_FRAME_BYTES, ErrorCode, Op, Request, encode_request
from tests.daemon_helpers import SMALL, kv_value, start_daemon, stop_daemon, wait_until


@pytest.fixture
def ep(tmp_path):
    return f"ipc://{tmp_path}/d.sock"


@pytest.fixture
def daemon(ep):
    proc = start_daemon(ep)
    yield ep
    stop_daemon(proc)


# ---- item 2: slots past the caller's page ---------------------------------------------------
def test_alloc_decode_and_extend_never_grant_another_sessions_or_the_trees_page(daemon):
    with (
        HiCacheClient(daemon, name="x") as x,
        HiCacheClient(daemon, name="y") as y,
        HiCacheClient(daemon, name="w") as w,
    ):
        a, b = x.alloc(4), y.alloc(4)
        tree_page = w.alloc(4)
        w.insert(list(range(300, 304)), tree_page)
        for victim in (b, tree_page):  # the page right after x's, or the tree's
            assert int(victim[0]) // 4 in {int(a[-1]) // 4 + 1, int(tree_page[0]) // 4}
        with pytest.raises(DaemonError) as err:  # token 1 cannot follow offset 3
            x.alloc_decode(torch.tensor([2]), a[-1:])
        assert err.value.code is ErrorCode.BAD_FIELD and "last_loc" in err.value.message
        with pytest.raises(DaemonError):
            x.alloc_extend(torch.tensor([1]), torch.tensor([8]), a[-1:])
        with pytest.raises(NotOwned):  # continuing in y's page
            x.alloc_decode(torch.tensor([2]), b[:1])
        s = x.stats(check=True)
        assert s["integrity"] == "ok"
        owners = {e["client"]: e["owned_pages"] for e in s["session_list"]}
        assert owners == {"x": 1, "y": 1, "w": 0}
        assert torch.equal(x.alloc_decode(torch.tensor([2]), a[:1]), a[1:2])  # the right way


def test_giving_back_frees_only_what_the_session_still_owns_and_housekeeping_survives_bugs():
    from hicache import HiCacheConfig, HiRadixCache
    from hicache.daemon.requests import Handlers
    from hicache.daemon.sessions import Ended, SessionTable

    cfg = HiCacheConfig(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4, device_tokens=64)
    cache = HiRadixCache(cfg)
    handlers = Handlers(cache, SessionTable(lease_s=1), boot_epoch=3, info={})
    slots = cache.alloc(8)
    cache.insert(np.arange(8, dtype=np.int32), slots)  # pages 1 and 2 are the tree's
    session = handlers.sessions.open("buggy", 1, handlers.clock())
    session.owned.update({1, 2})  # a bookkeeping bug would have put tree pages here
    handlers.give_back(Ended(session, "test"))  # frees nothing of the tree's
    cache.check_integrity()
    assert cache.match_prefix(np.arange(8)).device_hit_length == 8
    cache.poll = lambda: 1 / 0  # a bug in a housekeeping step
    assert handlers.housekeep() == [] and handlers.housekeep_errors == 1
    del cache.poll
    cache.close()


# ---- item 6: a peer that never reads its replies ------------------------------------------------
def test_a_peer_that_never_reads_cannot_stall_the_daemon(ep):
    proc = start_daemon(ep)
    try:
        ctx = zmq.Context.instance()
        flooder = ctx.socket(zmq.DEALER)
        flooder.setsockopt(zmq.RCVHWM, 1)
        flooder.setsockopt(zmq.LINGER, 0)
        flooder.connect(ep)
        for i in range(5000):  # stats replies fill its pipe quickly
            flooder.send(encode_request(Request(Op.STATS, i + 1, 0, 0, {})))
        with HiCacheClient(ep, name="victim", timeout_s=10) as hc:
            wait_until(lambda: hc.stats()["replies_dropped"] > 0, what="dropped replies")
            assert hc.ping()["pong"]
        start = time.monotonic()
        out = stop_daemon(proc, timeout=10)  # SIGTERM is honoured while the flooder sits
        assert time.monotonic() - start < 10 and "stopped" in out
        flooder.close()
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- item 7: token ids the client used to wrap or truncate ------------------------------------
@pytest.mark.parametrize(
    "tokens",
    [
        torch.arange(1, 33, dtype=torch.int64) + 2**32,
        np.arange(1, 33, dtype=np.int64) + 2**32,
        [t + 0.7 for t in range(1, 33)],
        torch.arange(1, 33, dtype=torch.float32),
        [True] * 32,
        [2**31] + list(range(2, 33)),
        [-1] + list(range(2, 33)),
        [list(range(1, 33))],
    ],
    ids=[
        "i64-tensor-wraps",
        "i64-array-wraps",
        "floats",
        "float-tensor",
        "bools",
        "2^31",
        "-1",
        "2-D",
    ],
)
def test_token_ids_that_would_alias_other_prompts_are_refused(daemon, tokens):
    with HiCacheClient(daemon, name="t") as hc:
        base = list(range(1, 33))
        hc.insert(base, hc.alloc(32))
        with pytest.raises(ValueError, match="token_ids"):
            hc.match_prefix(tokens)
        with pytest.raises(ValueError, match="token_ids"):
            hc.insert(tokens, hc.alloc(32))
        assert hc.stats()["match_calls"] == 0  # refused before anything was sent


# ---- item 10: endpoints, folders, segments, failed starts ----------------------------------
def test_a_second_daemon_on_a_live_endpoint_is_refused_and_leaves_it_alone(ep):
    proc = start_daemon(ep)
    try:
        with HiCacheClient(ep, name="c1") as c1:
            pid = c1.ping()["pid"]
            r = failed_start(ep)
            assert r.returncode == 2 and "another hicache-daemon serves" in r.stderr
            assert len(r.stderr.strip().splitlines()) == 1  # one line, no traceback
            assert os.path.exists(ep[len("ipc://") :])
            with HiCacheClient(ep, name="c2") as c2:
                assert c2.ping()["pid"] == pid
    finally:
        stop_daemon(proc)


def failed_start(endpoint: str, *flags: str) -> subprocess.CompletedProcess:
    """A daemon start expected to fail (it must say why in one line); ``.pid`` is its pid."""
    cmd = [sys.executable, "-m", "hicache.daemon", "--endpoint", endpoint, *SMALL, *flags]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        out, err = p.communicate(timeout=60)
    done = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    done.pid = p.pid  # type: ignore[attr-defined]
    return done


@pytest.mark.skipif(os.geteuid() != 0, reason="hands a folder to another user (needs root)")
def test_a_socket_folder_another_user_controls_is_refused(tmp_path):
    squat = tmp_path / "squat"
    squat.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(squat, 0o777)
    os.chown(squat, pwd.getpwnam("nobody").pw_uid, -1)
    r = failed_start(f"ipc://{squat}/h.sock")
    assert r.returncode == 2 and "owned by uid" in r.stderr
    os.chown(squat, os.getuid(), -1)  # ours, but writable by everyone
    r = failed_start(f"ipc://{squat}/h.sock")
    assert r.returncode == 2 and "writable by other users" in r.stderr
    shutil.rmtree(squat)


def test_a_failed_start_leaves_no_shared_memory_and_stale_segments_do_not_break_starts(tmp_path):
    mine = f"/dev/shm/hicache-{os.getuid()}-"
    busy = zmq.Context.instance().socket(zmq.REP)
    number = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        r = failed_start(f"tcp://*:{number}", "--insecure-local-tcp", "true")
        assert r.returncode == 2 and "cannot listen" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        # nothing of its own left behind (other daemons of this user come and go meanwhile)
        assert glob.glob(f"{mine}{r.pid}-*") == []
    finally:
        busy.close(linger=0)
    stale = f"{mine}424242-feed-device"  # a dead daemon's segment (no lock): removed at start
    with open(stale, "wb") as fh:
        fh.write(b"x")
    proc = start_daemon(f"ipc://{tmp_path}/d.sock")  # its log line comes before "ready"
    try:
        assert not os.path.exists(stale)  # gone by the time it serves
        # it says so, unless another daemon of this user starting meanwhile swept it first
        # (the sweep itself: tests/test_planted_files.py)
        if not re.search(r"removed \d+ stale", proc.output()):
            others = subprocess.run(["pgrep", "-f", "hicache.daemon"], capture_output=True,
                                    text=True).stdout.split()  # fmt: skip
            assert [p for p in others if int(p) != proc.pid], "the stale segment went unsaid"
    finally:
        stop_daemon(proc)


# ---- item 11: large replies, huge requests, loose field types --------------------------------
def test_replies_over_a_mebibyte_decode_and_huge_prompts_are_too_large_at_once(ep):
    proc = start_daemon(
        ep,
        "--num-layers",
        "1",
        "--page-size",
        "1",
        "--device-tokens",
        "50000",
        "--host-tokens",
        "0",
        "--session-owned-fraction",
        "1",
        "--max-sessions",
        "16384",  # (3000 sessions from this one process: a quarter of them per process)
        lease=30,
    )
    try:
        with HiCacheClient(ep, name="admin") as hc:
            for i in range(3000):  # sessions with long names: a stats reply over 1 MiB
                if i % 16 == 0:  # (16 sessions per connection at most)
                    sock = zmq.Context.instance().socket(zmq.DEALER)
                    sock.connect(ep)
                hello = {"client": "x" * 250, "pid": i}
                sock.send(encode_request(Request(Op.HELLO, i + 1, 0, 0, hello)))
                sock.recv_multipart()
                if i % 16 == 15 or i == 2999:
                    sock.close(linger=0)
            s = hc.stats()
            assert s["sessions"] == 3001 and len(s["session_list"]) == 1000
            pairs = []
            slots = hc.alloc(40000).numpy()
            for i in range(20000):
                pairs.append((np.array([i, 7], np.int32), slots[2 * i : 2 * i + 2]))
            for start in range(0, len(pairs), 1024):
                hc.insert_batch(pairs[start : start + 1024])
            dump = hc.tree(max_nodes=100_000)  # about 2 MiB of reply header
            assert dump["total"] == len(dump["nodes"]) == 20000
            start = time.monotonic()
            with pytest.raises(DaemonError) as err:
                hc.match_prefix(np.zeros(MAX_FRAME_BYTES // 4 + 2048, np.int32))
            assert err.value.code is ErrorCode.TOO_LARGE and time.monotonic() - start < 2
            assert hc.ping()["pong"]
    finally:
        stop_daemon(proc)


# ---- item 12: the loser of a concurrent insert ------------------------------------------------
def test_the_loser_of_a_concurrent_insert_gets_the_winners_pages_and_keeps_its_tail(daemon):
    with HiCacheClient(daemon, name="a") as a, HiCacheClient(daemon, name="b") as b:
        pools = a.attach()
        seq = list(range(500, 566))  # 16 whole pages and a tail of 2
        value = kv_value(np.array(seq))
        slots = {}
        for hc, name in ((a, "a"), (b, "b")):  # both prefill the same prompt
            slots[name] = hc.alloc(len(seq))
            pools.k_buffer[0][slots[name]] = value[:, None, None]
        first = a.insert_and_lock(seq, slots["a"])
        second = b.insert_and_lock(seq, slots["b"])
        assert (first.prefix_len, second.prefix_len) == (0, 64)
        assert torch.equal(second.match.device_indices, slots["a"][:64])  # the winner's pages
        assert torch.equal(first.match.device_indices, slots["a"][:64])
        s = b.stats(check=True)
        assert s["integrity"] == "ok"
        owners = {e["client"]: e["owned_pages"] for e in s["session_list"]}
        assert owners == {"a": 1, "b": 1}  # each keeps its partial tail page
        with HiCacheClient(daemon, name="c") as c:  # someone takes every free page
            grab = c.alloc(s["device_free_tokens"])
            pools.k_buffer[0][grab] = -9.0
            # b decodes on: its prefix (the winner's pages) and its own tail are intact
            b_view = torch.cat([second.match.device_indices, slots["b"][64:]])
            assert torch.equal(pools.k_buffer[0][b_view][:, 0, 0], value)
            nxt = b.alloc_decode(torch.tensor([67]), slots["b"][-1:])  # token 66 in its tail
            assert int(nxt[0]) == int(slots["b"][-1]) + 1
            c.free(grab)
        b.release(second.match)
        with pytest.raises(RuntimeError, match="released"):
            second.match.device_indices  # noqa: B018  (a released match hands out nothing)
        a.release(first.match)
        a.free(slots["a"][64:])
        b.free(torch.cat([slots["b"][64:], nxt]))
        assert a.stats(check=True)["device_owned_tokens"] == 0


# ---- item 13: one session against everyone ------------------------------------------------------
def test_one_session_cannot_starve_the_others_nor_flush_for_everyone(daemon):
    with HiCacheClient(daemon, name="hog") as hog, HiCacheClient(daemon, name="victim") as v:
        v.insert(list(range(64)), v.alloc(64))
        taken = [hog.alloc(16) for _ in range(12)]  # 3/4 of the pool: the limit
        with pytest.raises(DaemonError) as err:
            hog.alloc(16)
        assert err.value.code is ErrorCode.QUOTA_EXCEEDED
        assert v.match_prefix(list(range(64)), lock=False).device_hit_length == 64
        assert len(v.alloc(16)) == 16  # the others still get memory
        for op in (hog.flush, lambda: hog.evict(device_tokens=64)):
            with pytest.raises(DaemonError) as err:
                op()
            assert err.value.code is ErrorCode.FORBIDDEN
        with HiCacheClient(daemon, name="ops", admin=True) as ops:
            freed = ops.flush()
            assert freed["device_freed"] + freed["host_freed"] >= 64
        hog.free(torch.cat(taken))


def test_out_of_memory_says_what_holds_the_pool(daemon):
    with HiCacheClient(daemon, name="a") as a, HiCacheClient(daemon, name="b") as b:
        a.alloc(192)
        m = b.alloc(32)
        b.insert(list(range(32)), m)
        locked = b.match_prefix(list(range(32)))
        with pytest.raises(DaemonError) as err:
            b.alloc(64)
        assert err.value.code is ErrorCode.OUT_OF_MEMORY
        text = err.value.message
        assert "session 1 (a) 192" in text and "32 locked in the tree" in text
        b.release(locked)


def test_cli_is_fast_and_complete(daemon):
    env = {**os.environ, "HICACHE_ENDPOINT": daemon}

    def run(*args, check=True):
        return subprocess.run(
            [sys.executable, "-m", "hicache.client.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            check=check,
        )

    start = time.monotonic()
    assert run("ping").stdout.startswith("PONG")
    assert time.monotonic() - start < 0.5  # the whole process: no torch on the way
    assert run("info", "DevicePool").stdout.startswith("# DevicePool")  # the heading works too
    bad = run("info", "nonsense", check=False)
    assert bad.returncode == 2 and "device_pool" in bad.stderr  # lists the sections
    assert "version:" in run("info", "server").stdout
    assert "page_size:16" not in run("info", "config").stdout  # the daemon's own: page 4
    assert "page_size:4" in run("info", "config").stdout
    with HiCacheClient(daemon) as hc:
        hc.insert(list(range(8)), hc.alloc(8))
    assert "nodes:1" in run("tree").stdout
    assert "device_freed" in run("evict", "--device-tokens", "8").stdout
    assert "host_freed" in run("flush").stdout
    missing = {**env, "HICACHE_ENDPOINT": f"{daemon}.missing"}
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "hicache.client.cli", "ping"],
        env=missing,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "no daemon" in r.stderr and time.monotonic() - start < 2


# ---- a new engine author's first hour: errors that say what is wrong ------------------------
def test_error_texts_point_at_the_mistake(daemon):
    hc = HiCacheClient(daemon, name="new-author")
    with pytest.raises(ValueError, match="1-D"):
        hc.match_prefix(torch.arange(8).view(1, 8))  # a [1, T] prompt
    hc.insert(list(range(8)), hc.alloc(8))
    unlocked = hc.match_prefix(list(range(8)), lock=False)
    with pytest.raises(DaemonError):
        hc.evict(device_tokens=8)  # FORBIDDEN: not an admin session
    with HiCacheClient(daemon, name="ops", admin=True) as ops:
        ops.evict(device_tokens=8)  # the prefix now lives on the host only
    unlocked = hc.match_prefix(list(range(8)), lock=False)
    assert unlocked.host_hit_length == 8
    with pytest.raises(ValueError, match="locked match"):
        hc.load_back(unlocked)
    slots = hc.alloc(4)
    hc.free(slots)
    with pytest.raises(NotOwned) as err:  # also the core's InvalidIndicesError
        hc.free(slots)
    assert err.value.code is ErrorCode.NOT_OWNED
    from hicache import InvalidIndicesError

    assert isinstance(err.value, InvalidIndicesError)
    with pytest.raises(DaemonError) as err:
        hc.match_prefix(list(range(8)), namespace="x" * 5000)
    assert err.value.code is ErrorCode.BAD_FIELD and "namespace" in err.value.message
    fields = {"lengths": [8], "lock": False, "namespaces": [None], "l3_wait": "yes"}
    with pytest.raises(DaemonError) as err:  # checked with or without a third tier
        hc._matches(fields, [np.arange(8, dtype=np.int32)])
    assert err.value.code is ErrorCode.BAD_FIELD and "l3_wait" in err.value.message
    hc.close()
    hc.close()  # twice is fine
    from hicache.client import ClientClosed

    with pytest.raises(ClientClosed):
        hc.ping()


def test_a_batch_that_fails_part_way_holds_no_lock(daemon):
    with HiCacheClient(daemon, name="e") as hc:
        seq = list(range(16))
        hc.insert(seq, hc.alloc(16))
        for spaces in ([None, 1.5], [None, [1]], [None, "x" * 5000]):
            with pytest.raises(DaemonError):
                hc.match_batch([seq, seq], namespaces=spaces)
        with pytest.raises(DaemonError):  # the second sequence's slots are not ours
            hc.insert_batch([(seq, hc.alloc(16)), (seq + [1] * 4, torch.arange(4, 24))])
        me = next(x for x in hc.stats()["session_list"] if x["client"] == "e")
        assert me["locks"] == 0
        # (a write-through backup locks a node until its copy is acknowledged)
        wait_until(lambda: hc.stats()["device_protected_tokens"] == 0, what="backups")
