"""The daemon and its clients in separate processes, over ipc:// in a temporary folder."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from hicache.client import DaemonError, EpochChanged, HiCacheClient
from hicache.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Op,
    decode_reply,
    slots_frame,
    tokens_frame,
)
from tests.daemon_helpers import (
    busy_engine,
    hold_and_wait,
    kv_value,
    start_daemon,
    stop_daemon,
    wait_until,
    write_sequence,
)

SPAWN = mp.get_context("spawn")
CLI = [sys.executable, "-m", "hicache.client.cli"]


@pytest.fixture
def endpoint(tmp_path):
    ep = f"ipc://{tmp_path}/hicache.sock"
    proc = start_daemon(ep)
    yield ep
    if proc.poll() is None:
        stop_daemon(proc)


def test_socket_is_private_and_shutdown_cleans_up(tmp_path):
    ep = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(ep)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "d.sock").st_mode) == 0o600
        mine = f"hicache-{os.getuid()}-{proc.pid}-"
        segments = [n for n in os.listdir("/dev/shm") if n.startswith(mine)]
        pools = sorted(s.rsplit("-", 1)[1] for s in segments)
        assert pools == ["device", "host", "lock", "progress"]
    finally:
        output = stop_daemon(proc)  # a failed check must not leave a daemon behind
    assert "stopped" in output
    assert not (tmp_path / "d.sock").exists()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in segments)


def test_another_process_reads_the_bytes_an_engine_wrote(endpoint):
    tokens = list(range(1, 29))  # 7 pages of 4
    with SPAWN.Pool(1) as pool:
        pool.apply(write_sequence, (endpoint, tokens))
    want = kv_value(np.array(tokens))
    with HiCacheClient(endpoint, name="reader", admin=True) as hc:
        pools = hc.attach()
        m = hc.match_prefix(tokens)
        assert m.device_hit_length == 28
        # page ids travel; the slots are their expansion, and they hold what the writer wrote
        assert torch.equal(m.device_pages, m.device_indices[::4] // 4)
        assert torch.equal(m.device_indices % 4, torch.arange(28) % 4)
        for layer in range(2):
            assert torch.equal(pools.k_buffer[layer][m.device_indices][:, 0, 0], want + layer)
            assert torch.equal(pools.v_buffer[layer][m.device_indices][:, 1, 3], -want - layer)
        hc.release(m)
        hc.evict(device_tokens=1 << 20)  # forced: the prefix now lives on the host only
        pools.device.buffer.fill_(0x7F)  # freed pages keep old KV: poison them
        m = hc.match_prefix(tokens)
        assert (m.device_hit_length, m.host_hit_length) == (0, 28)
        loaded = hc.load_back(m)
        assert torch.equal(pools.k_buffer[1][loaded][:, 0, 0], want + 1)
        assert hc.stats(check=True)["integrity"] == "ok"
        hc.release(m)


def test_many_engines_under_eviction_pressure_leak_nothing(tmp_path):
    ep = f"ipc://{tmp_path}/busy.sock"
    proc = start_daemon(ep, "--device-tokens", "1024", "--host-tokens", "4096")
    try:
        with SPAWN.Pool(8) as pool:
            recomputed = pool.starmap(busy_engine, [(ep, seed, 30) for seed in range(8)])
        assert all(r > 0 for r in recomputed)
        with HiCacheClient(ep, name="auditor") as hc:
            s = hc.stats(check=True)
        assert s["integrity"] == "ok" and s["sessions"] == 1
        assert s["device_owned_tokens"] == 0 and s["device_protected_tokens"] == 0
        assert s["evicted_device_tokens"] > 0  # there was pressure
        assert s["device_free_tokens"] + s["device_cached_tokens"] == s["device_capacity_tokens"]
    finally:
        stop_daemon(proc)


def test_a_killed_engine_gives_everything_back_after_its_lease(tmp_path):
    """Its pages and locks are held through the quarantine (a stalled engine that comes back
    must not find them reused), then given back. The quarantine (6 s) is long enough to be
    seen after the lease (1 s) lapsed, whatever the machine's load."""
    endpoint = f"ipc://{tmp_path}/k.sock"
    proc = start_daemon(endpoint, lease=1.0, quarantine=6.0)
    try:
        write_sequence(endpoint, list(range(1, 41)))
        ready = tmp_path / "ready"
        victim = SPAWN.Process(target=hold_and_wait, args=(endpoint, str(ready)))
        victim.start()
        with HiCacheClient(endpoint, name="watcher") as hc:
            wait_until(ready.exists)
            s = hc.stats()
            assert s["device_owned_tokens"] == 20 and s["device_protected_tokens"] == 40
            os.kill(victim.pid, signal.SIGKILL)
            victim.join()
            wait_until(lambda: hc.stats()["sessions"] == 1)  # the lease lapsed: the watcher
            s = hc.stats(check=True)
            assert s["sessions_quarantined"] == 1  # held through the quarantine, then given back
            assert s["device_owned_tokens"] == s["quarantined_tokens"] == 20
            assert s["device_protected_tokens"] == 40
            assert [x["lapsed"] for x in s["session_list"]].count(True) == 1
            wait_until(lambda: hc.stats()["sessions_quarantined"] == 0)
            s = hc.stats(check=True)
            assert s["device_owned_tokens"] == 0 and s["device_protected_tokens"] == 0
            assert s["integrity"] == "ok"
    finally:
        stop_daemon(proc)


def raw_call(sock: zmq.Socket, header: bytes, *frames) -> tuple[int, dict]:
    sock.send_multipart([header, *frames])
    assert sock.poll(10_000)
    reply = decode_reply(sock.recv_multipart()[0])
    return reply.status, reply.fields


def test_bad_input_gets_error_replies_and_changes_nothing(endpoint):
    with HiCacheClient(endpoint, name="owner") as owner, HiCacheClient(endpoint) as other:
        mine = owner.alloc(8)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        epoch = other.conn.epoch
        hdr = lambda op, fields, session=other.session, epoch=epoch: msgpack.packb(  # noqa: E731
            [PROTOCOL_VERSION, op, 1, session, epoch, fields]
        )
        cases = [
            ((b"\xc1not msgpack",), ErrorCode.BAD_FIELD),
            ((hdr(999, {}),), ErrorCode.UNKNOWN_OP),
            ((msgpack.packb([PROTOCOL_VERSION + 1, Op.PING, 1, 0, {}]),), ErrorCode.WRONG_VERSION),
            ((msgpack.packb([PROTOCOL_VERSION, Op.PING, 1, 0, {}]),), ErrorCode.BAD_FIELD),
            ((hdr(Op.ALLOC, {"num_tokens": "many"}),), ErrorCode.BAD_FIELD),
            ((hdr(Op.ALLOC, {"num_tokens": 10**9}),), ErrorCode.BAD_FIELD),
            ((hdr(Op.FREE, {}), bytes(slots_frame([10**9]))), ErrorCode.NOT_OWNED),
            ((hdr(Op.FREE, {}), bytes(slots_frame(mine))), ErrorCode.NOT_OWNED),  # foreign
            ((hdr(Op.FREE, {}), b"\x01\x02\x03"), ErrorCode.BAD_FIELD),
            ((hdr(Op.MATCH, {}), b"\x01\x02"), ErrorCode.BAD_FIELD),
            ((hdr(Op.INSERT, {}), bytes(slots_frame([1]))), ErrorCode.BAD_FIELD),
            ((hdr(Op.RELEASE, {"lock_ids": [12345]}),), ErrorCode.NOT_OWNED),
            ((hdr(Op.PING, {}, session=0),), ErrorCode.OK),
            ((hdr(Op.ALLOC, {"num_tokens": 4}, session=777),), ErrorCode.UNKNOWN_SESSION),
            ((hdr(Op.ALLOC, {"num_tokens": 4}, epoch=epoch + 2),), ErrorCode.EPOCH_MISMATCH),
            ((hdr(Op.ALLOC, {"num_tokens": 4}, epoch=0),), ErrorCode.EPOCH_MISMATCH),
            ((hdr(Op.RELEASE, {"lock_ids": [True]}),), ErrorCode.BAD_FIELD),
            ((hdr(Op.STATS, {"check": 1}),), ErrorCode.BAD_FIELD),
            ((hdr(Op.FLUSH, {}),), ErrorCode.FORBIDDEN),
            # the page forms: pages outside the pool, another session's, a count that does not
            # match the lengths, a flag that is not a bool
            ((hdr(Op.FREE, {"pages": True}), bytes(slots_frame([10**9]))), ErrorCode.NOT_OWNED),
            ((hdr(Op.FREE, {"pages": True}), bytes(slots_frame([-1]))), ErrorCode.NOT_OWNED),
            ((hdr(Op.FREE, {"pages": True}), bytes(slots_frame(mine[:1] // 4))),
             ErrorCode.NOT_OWNED),
            ((hdr(Op.INSERT, {"pages": True, "lengths": [8]}), tokens_frame(np.arange(8)),
              bytes(slots_frame([1]))), ErrorCode.BAD_FIELD),
            ((hdr(Op.INSERT, {"pages": True, "lengths": "8"}), tokens_frame(np.arange(8)),
              bytes(slots_frame([1, 2]))), ErrorCode.BAD_FIELD),
            ((hdr(Op.INSERT, {"pages": True, "lengths": [8]}), tokens_frame(np.arange(8)),
              bytes(slots_frame(mine[::4] // 4))), ErrorCode.NOT_OWNED),
            ((hdr(Op.ALLOC, {"num_tokens": 4, "pages": 1}),), ErrorCode.BAD_FIELD),
        ]  # fmt: skip
        for frames, code in cases:
            status, fields = raw_call(sock, *frames)
            assert status == code, (frames[0][:20], fields)
        sock.close()
        with pytest.raises(DaemonError) as err:  # inserting another session's slots
            other.insert(list(range(8)), mine)
        assert err.value.code is ErrorCode.NOT_OWNED
        owner.free(mine)
        with pytest.raises(DaemonError) as err:
            owner.free(mine)  # double free
        assert err.value.code is ErrorCode.NOT_OWNED
        s = owner.stats(check=True)
        assert s["integrity"] == "ok" and s["device_owned_tokens"] == 0
        assert owner.ping()["pong"]


def test_a_restarted_daemon_is_noticed(tmp_path):
    ep = f"ipc://{tmp_path}/r.sock"
    proc = start_daemon(ep)
    hc = HiCacheClient(ep, heartbeat=False)
    hc.alloc(4)
    stop_daemon(proc)
    proc = start_daemon(ep)
    try:
        with pytest.raises(EpochChanged):
            hc.alloc(4)  # never hands out indices of the new daemon to the old session
        hc.close()
    finally:
        stop_daemon(proc)


def test_frames_past_the_zero_copy_threshold(tmp_path):
    """Token and slot frames above the daemon's copy threshold are read in zmq's own buffer."""
    ep = f"ipc://{tmp_path}/big.sock"
    proc = start_daemon(
        ep, "--device-tokens", "65536", "--host-tokens", "131072", "--session-owned-fraction", "1"
    )
    try:
        rng = np.random.default_rng(1)
        system = rng.integers(1, 1000, 8192, dtype=np.int32)
        seqs = [
            np.concatenate([system, rng.integers(1, 1000, 10000, dtype=np.int32)]) for _ in "abc"
        ]
        with HiCacheClient(ep, name="big") as hc:
            slots = [hc.alloc(len(s)) for s in seqs]  # 218 KiB of tokens, 437 KiB of slots
            assert hc.insert_batch(list(zip(seqs, slots, strict=True))) == [0, 8192, 8192]
            matches = hc.match_batch([*seqs, seqs[0]])  # 72 KiB of tokens after sharing
            assert [m.device_hit_length for m in matches] == [18192] * 4
            assert torch.equal(matches[0].device_indices, slots[0])
            assert torch.equal(matches[3].device_indices, slots[0])
            for m, own in zip(matches[1:3], slots[1:], strict=True):
                assert torch.equal(m.device_indices[:8192], slots[0][:8192])  # the tree's copy
                assert torch.equal(m.device_indices[8192:], own[8192:])
            longer = np.concatenate([seqs[2], np.full(20000, 5, np.int32)])  # one 153 KiB frame
            single = hc.match_prefix(longer)
            assert (single.device_hit_length, single.host_hit_length) == (18192, 0)
            hc.release(*matches, single)
            assert hc.stats(check=True)["integrity"] == "ok"
    finally:
        stop_daemon(proc)


def test_cli_ping_info_and_stats(endpoint):
    import json
    import subprocess
    import sys

    env = {**os.environ, "HICACHE_ENDPOINT": endpoint}

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "hicache.client.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    assert run("ping").startswith("PONG")
    pong = json.loads(run("ping", "--json"))
    assert pong["pid"] > 0 and f"pid={pong['pid']} epoch={pong['epoch']}" in run("ping")
    info = run("info")
    assert "# Server" in info and "# Hits" in info and "hit_ratio_device:" in info
    assert run("info", "hits").startswith("# Hits")
    data = json.loads(run("stats", "--json"))
    assert data["device_capacity_tokens"] == 256 and data["sessions"] == 0
    groups = json.loads(run("info", "--json"))
    assert groups["memory"]["device_capacity_tokens"] == 256
    assert set(groups) >= {"server", "config", "hits", "sessions"}
    assert ":None" not in info  # an unset setting shows as empty, not as Python's None
    refused = subprocess.run(
        [sys.executable, "-m", "hicache.client.cli", "evict"], env=env, capture_output=True
    )
    assert refused.returncode == 2 and b"--device-tokens" in refused.stderr


def test_cli_evict_without_an_amount_is_refused_before_any_daemon(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "hicache.client.cli", "--endpoint", f"ipc://{tmp_path}/x", "evict"],
        capture_output=True,
    )
    assert out.returncode == 2 and b"--device-tokens" in out.stderr


def test_client_names_are_shown_escaped(tmp_path):
    """s11: a client name carrying terminal escapes and a fake log line reached `hicache info
    sessions`, top and the daemon's log raw."""
    from hicache.daemon.requests import printable

    name = "eng\x1b[2J\x1b[31mRED\n2026-01-01 00:00:00,000 ERROR hicache.daemon FAKE"
    escaped = "eng\\x1b[2J\\x1b[31mRED\\n2026-01-01 00:00:00,000 ERROR hicache.daemon FAKE"
    assert printable(name) == escaped
    assert printable("ingénieur 2") == "ingénieur 2"  # printable text stays as it is
    ep = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(ep)
    try:
        with HiCacheClient(ep, name=name) as hc:
            shown = [s["client"] for s in hc.stats()["session_list"]]
            assert printable(name) in shown and name not in shown
        info = subprocess.run([*CLI, "--endpoint", ep, "info", "sessions"], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert "\x1b" not in info.stdout
    finally:
        log = stop_daemon(proc)
    assert "\x1b" not in log and "\nERROR hicache.daemon FAKE" not in log


def test_namespaces_keep_engines_apart_through_the_client(endpoint):
    """Tenants (models, adapters, salts) never share KV: the same tokens cached under one
    namespace are a miss under another and under none, and each namespace keeps its own KV."""
    tokens = np.arange(1, 33, dtype=np.int32)
    with HiCacheClient(endpoint, name="a") as a, HiCacheClient(endpoint, name="b") as b:
        a.insert(tokens, a.alloc(32), namespace="tenant-a")
        assert b.match_prefix(tokens, namespace="tenant-b", lock=False).device_hit_length == 0
        assert b.match_prefix(tokens, lock=False).device_hit_length == 0
        assert b.match_prefix(tokens, namespace="tenant-a", lock=False).device_hit_length == 32
        b.insert(tokens, b.alloc(32), namespace="tenant-b")  # its own copy, not a duplicate
        ma = a.match_prefix(tokens, namespace="tenant-a", lock=False)
        mb = b.match_prefix(tokens, namespace="tenant-b", lock=False)
        assert ma.device_hit_length == mb.device_hit_length == 32
        assert not set(ma.device_indices.tolist()) & set(mb.device_indices.tolist())
        assert a.stats()["device_cached_tokens"] == 64


def test_an_engine_killed_without_a_goodbye_is_noticed_before_its_lease_runs_out(tmp_path):
    """SIGKILL (vLLM's front end force-kills its engine core): no code of the engine runs, but
    the daemon sees its process is gone within about a second and quarantines its session as
    a stopping goodbye would, instead of waiting out a lease of a minute."""
    ep = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(ep, lease=60.0, quarantine=1.0)
    try:
        ready = tmp_path / "ready"
        engine = mp.get_context("spawn").Process(target=hold_and_wait, args=(ep, str(ready)))
        engine.start()
        wait_until(ready.exists, what="the engine's pages and lock")
        with HiCacheClient(ep, name="probe") as hc:
            victim = [s for s in hc.stats()["session_list"] if s["client"] == "victim"]
            assert victim and victim[0]["owned_pages"]
            engine.kill()
            engine.join()
            t0 = time.monotonic()
            wait_until(
                lambda: not [s for s in hc.stats()["session_list"] if s["client"] == "victim"],
                timeout=30,
                what="the session given back",
            )
            assert time.monotonic() - t0 < 30  # (the lease is 60 s)
            assert hc.stats()["device_owned_tokens"] == 0
            assert hc.stats(check=True)["integrity"] == "ok"
    finally:
        log = stop_daemon(proc)
    assert f"ended: its process (pid {engine.pid}) ended" in log, log[-2000:]


def test_pages_instead_of_slots_cache_what_slots_would(endpoint):
    """ALLOC, INSERT and FREE in page ids (what vLLM's scheduler sends): the pages an ALLOC
    names are the slots' pages, an insert by pages caches what an insert by slots would, a
    chain extends by the match's pages, and a free by pages gives them back."""
    with HiCacheClient(endpoint, name="paged") as hc:
        ps = hc.config.page_size
        tokens = np.arange(1, 4 * ps + 1)
        pages = hc.alloc(2 * ps + 1, pages=True)  # 3 pages: the last partly used
        assert len(pages) == 3
        owned = hc.holdings().owned_slots // ps
        assert sorted(owned.tolist()) == sorted(pages.tolist())
        slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)[: 2 * ps + 1]
        assert hc.insert(tokens[: 2 * ps + 1], pages, pages=True) == 0
        m = hc.match_prefix(tokens)
        assert m.device_hit_length == 2 * ps and torch.equal(m.device_indices, slots[: 2 * ps])
        more = hc.alloc(2 * ps, pages=True)  # the chain continues past its 2 cached pages
        inserted = hc.insert_and_lock(
            tokens, torch.cat([m.device_pages, more]), replaces=m, pages=True
        )
        assert inserted.prefix_len == 2 * ps and inserted.match.device_hit_length == 4 * ps
        hc.release(inserted.match)
        spare = hc.alloc(ps, pages=True)
        hc.free(spare, pages=True)
        with pytest.raises(ValueError, match="so 2 pages, not 1"):
            hc.insert(tokens[: 2 * ps], spare, pages=True)  # (refused before the wire)
        s = hc.stats(check=True)
        assert s["integrity"] == "ok" and s["device_owned_tokens"] == 0
        assert s["device_cached_tokens"] == 4 * ps


def test_a_client_of_another_protocol_version_is_told_what_is_wrong(endpoint):
    """A request in the previous protocol version (a client from an older hicache) is
    refused with WRONG_VERSION and a message that says both versions and what to do."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        old = msgpack.packb([PROTOCOL_VERSION - 1, Op.PING, 1, 0, 0, {}])
        status, fields = raw_call(sock, old)
    finally:
        sock.close()
    assert status == ErrorCode.WRONG_VERSION
    assert (
        f"protocol version {PROTOCOL_VERSION - 1}; this side speaks {PROTOCOL_VERSION}"
        in (fields["message"])
    )
    assert "different hicache versions" in fields["message"]
