"""Who may use a daemon: CurveZMQ keys on tcp (a client without the right key is refused, one
with it works), no tcp address beyond loopback without them, private ipc sockets and shared
memory (0600, names other users cannot guess)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from hicache.client import HiCacheClient
from hicache.client.connection import DaemonError, DaemonTimeout
from hicache.curve import CLIENT_KEY_ENV, SERVER_KEY_ENV, keygen
from hicache.protocol import ErrorCode
from tests.daemon_helpers import start_daemon, stop_daemon
from tests.l3_servers import free_port

CLI = [sys.executable, "-m", "hicache.client.cli"]


@pytest.fixture
def keys(tmp_path):
    server_pub, server_sec = keygen(str(tmp_path / "server"), "server")
    clients = tmp_path / "clients"
    engine_pub, engine_sec = keygen(str(clients), "engine")
    stranger_pub, stranger_sec = keygen(str(tmp_path / "stranger"), "stranger")
    return {
        "server_pub": server_pub,
        "server_sec": server_sec,
        "clients": str(clients),
        "engine_sec": engine_sec,
        "stranger_sec": stranger_sec,
    }


def test_keygen_writes_a_private_secret_and_a_public_key(tmp_path):
    out = subprocess.run([*CLI, "keygen", "--dir", str(tmp_path / "k"), "--name", "server"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert "secret:" in out.stdout
    secret = tmp_path / "k" / "server.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "secret-key" in secret.read_text()
    assert "secret-key" not in (tmp_path / "k" / "server.key").read_text()
    bad = subprocess.run([*CLI, "keygen", "--dir", str(tmp_path), "--name", "../x"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 1 and "plain file name" in bad.stderr


def test_only_a_client_with_an_allowed_key_gets_in(keys, monkeypatch, tmp_path):
    ep = f"tcp://127.0.0.1:{free_port()}"
    proc = start_daemon(ep, "--curve-secret-key", keys["server_sec"],
                        "--curve-clients", keys["clients"])  # fmt: skip
    try:
        monkeypatch.setenv(SERVER_KEY_ENV, keys["server_pub"])
        monkeypatch.setenv(CLIENT_KEY_ENV, keys["engine_sec"])
        with HiCacheClient(ep, name="engine") as hc:  # the allowed key: a working session
            tokens = np.arange(1, 33, dtype=np.int32)
            hc.insert(tokens, hc.alloc(32))
            assert hc.match_prefix(tokens, lock=False).device_hit_length == 32
        ping = subprocess.run([*CLI, "--endpoint", ep, "ping"], capture_output=True, text=True)
        assert ping.returncode == 0 and "PONG" in ping.stdout
        monkeypatch.setenv(CLIENT_KEY_ENV, keys["stranger_sec"])  # a key the daemon never saw
        with pytest.raises(DaemonTimeout):
            HiCacheClient(ep, name="stranger", timeout_s=1)
        monkeypatch.delenv(SERVER_KEY_ENV)
        monkeypatch.delenv(CLIENT_KEY_ENV)
        with pytest.raises(DaemonTimeout, match="CurveZMQ"):  # no keys: ignored, and told why
            HiCacheClient(ep, name="plain", timeout_s=1)
        monkeypatch.setenv(SERVER_KEY_ENV, keys["server_pub"])
        monkeypatch.setenv(CLIENT_KEY_ENV, keys["engine_sec"])
        with HiCacheClient(ep, name="engine-again") as hc:
            assert hc.stats()["sessions"] == 1  # the refused ones left nothing behind
    finally:
        stop_daemon(proc)


def test_tcp_beyond_loopback_needs_keys_and_secret_keys_must_be_private(keys, tmp_path):
    port = free_port()
    with pytest.raises(RuntimeError, match="CurveZMQ keys"):
        start_daemon(f"tcp://0.0.0.0:{port}")
    with pytest.raises(RuntimeError, match="events_endpoint.*CurveZMQ"):
        start_daemon(f"ipc://{tmp_path}/e.sock", "--events-endpoint", f"tcp://0.0.0.0:{port}")
    os.chmod(keys["server_sec"], 0o644)
    with pytest.raises(RuntimeError, match="readable by others"):
        start_daemon(f"tcp://0.0.0.0:{port}", "--curve-secret-key", keys["server_sec"],
                     "--curve-clients", keys["clients"])  # fmt: skip
    os.chmod(keys["server_sec"], 0o600)
    with pytest.raises(RuntimeError, match="give both"):
        start_daemon(f"tcp://0.0.0.0:{port}", "--curve-secret-key", keys["server_sec"])
    proc = start_daemon(f"tcp://0.0.0.0:{port}", "--curve-secret-key", keys["server_sec"],
                        "--curve-clients", keys["clients"])  # fmt: skip
    stop_daemon(proc)


def test_ipc_sockets_and_shared_memory_are_private(tmp_path):
    folder = tmp_path / "run"
    ep = f"ipc://{folder}/p.sock"
    proc = start_daemon(ep)
    try:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(folder / "p.sock").st_mode) == 0o600
        mine = [n for n in os.listdir("/dev/shm") if f"-{proc.pid}-" in n]
        assert mine, "no segment of this daemon"
        for name in mine:
            assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600, name
            token = name.split("-")[3]
            assert len(token) == 32  # 128 random bits in every name
    finally:
        stop_daemon(proc)


def test_one_client_key_holds_at_most_its_share_of_sessions_over_connections(keys, tmp_path):
    """s10 (sessions): the 16 sessions per connection spread over more connections; a CurveZMQ
    client key holds at most a quarter of --max-sessions, however many connections it opens,
    and another key still gets in."""
    import msgpack
    import zmq

    from hicache.curve import apply_client, client_keys
    from hicache.protocol import PROTOCOL_VERSION, ErrorCode, Op, decode_reply

    other_pub, other_sec = keygen(keys["clients"], "other")
    ep = f"tcp://127.0.0.1:{free_port()}"
    proc = start_daemon(ep, "--curve-secret-key", keys["server_sec"], "--max-sessions", "128",
                        "--curve-clients", keys["clients"], "--keep-host", "false")  # fmt: skip
    socks = []

    def hello(secret: str):  # noqa: ANN202
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 20000)
        env = {"HICACHE_CURVE_SERVER_KEY": keys["server_pub"], "HICACHE_CURVE_CLIENT_KEY": secret}
        apply_client(sock, client_keys(env))
        sock.connect(ep)
        socks.append(sock)
        fields = {"client": "many", "pid": 1}
        sock.send(msgpack.packb([PROTOCOL_VERSION, int(Op.HELLO), 1, 0, 0, fields]))
        return decode_reply(sock.recv())

    try:
        replies = [hello(keys["engine_sec"]) for _ in range(33)]  # a connection each
        assert all(r.ok for r in replies[:32])  # 128 / 4
        refused = replies[32]
        assert refused.status is ErrorCode.QUOTA_EXCEEDED and "client key" in str(refused.fields)
        assert hello(other_sec).ok  # another key is not held back by this one's
    finally:
        for sock in socks:
            sock.close()
        stop_daemon(proc)


def test_one_client_key_holds_one_share_of_the_pool_over_its_sessions(keys, monkeypatch):
    """s16 spread over sessions: each session holds at most its share of the pool (75%); two
    sessions of one CurveZMQ key together hold no more, and another key still gets its own."""
    other_pub, other_sec = keygen(keys["clients"], "other-pool")
    ep = f"tcp://127.0.0.1:{free_port()}"
    proc = start_daemon(ep, "--curve-secret-key", keys["server_sec"],
                        "--curve-clients", keys["clients"])  # fmt: skip
    try:
        monkeypatch.setenv(SERVER_KEY_ENV, keys["server_pub"])
        monkeypatch.setenv(CLIENT_KEY_ENV, keys["engine_sec"])
        with HiCacheClient(ep, name="a") as a, HiCacheClient(ep, name="b") as b:
            held = a.alloc(128)  # half of the 256-token pool
            b.alloc(64)  # 192 of 256: the key's share (75%) exactly
            with pytest.raises(DaemonError) as err:
                b.alloc(4)
            assert err.value.code is ErrorCode.QUOTA_EXCEEDED
            assert "sessions of this client key" in str(err.value)
            monkeypatch.setenv(CLIENT_KEY_ENV, other_sec)
            with HiCacheClient(ep, name="c") as c:
                c.alloc(4)  # another key: its own share (of what is free)
            a.free(held)
            b.alloc(64)  # what one session gave back, another of the key may take
    finally:
        stop_daemon(proc)


def _hello(endpoint: str, fields: dict) -> tuple[int, str]:
    """A raw HELLO on a socket of its own: (status, message)."""
    import msgpack
    import zmq

    from hicache.protocol import PROTOCOL_VERSION, Op, decode_reply

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        sock.connect(endpoint)
        sock.send(msgpack.packb([PROTOCOL_VERSION, int(Op.HELLO), 1, 0, 0, fields]))
        reply = decode_reply(sock.recv())
        return int(reply.status), str(reply.fields.get("message", ""))
    finally:
        sock.close()


def test_an_admin_hello_with_any_token_but_the_daemons_is_refused(tmp_path):
    """Wrong tokens of every length (empty, one off, one longer, huge), non-ASCII ones, the
    right one changed in one character, and what is not a string: each is refused with
    FORBIDDEN and a clear message, never admitted, never an error inside the daemon; the
    daemon's own token still opens an admin session, and a plain hello needs none."""
    from hicache.endpoints import admin_token_path

    ep = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(ep)
    try:
        token = open(admin_token_path(ep)).read().strip()
        flipped = token[:-1] + ("a" if token[-1] != "a" else "b")
        wrong = [
            "", "x", token[:-1], token + "0", flipped, flipped.upper(), token * 2, "é" * len(token),
            token[:-1] + "é", "\x00" * len(token), "🔑" * 40, "a" * 100_000, " " + token,
        ]  # fmt: skip
        for bad in [*wrong, None, 7, b"bytes", [token], {"token": token}]:
            fields = {"client": "ops", "pid": 1, "admin": True, "admin_token": bad}
            status, message = _hello(ep, fields)
            assert status == ErrorCode.FORBIDDEN, (bad, status, message)
            assert "admin token" in message
        status, _ = _hello(ep, {"client": "ops", "pid": 1, "admin": True})  # (none at all)
        assert status == ErrorCode.FORBIDDEN
        status, _ = _hello(ep, {"client": "ops", "pid": 1, "admin": True, "admin_token": token})
        assert status == ErrorCode.OK
        with HiCacheClient(ep, name="after") as hc:
            stats = hc.stats()
        assert [s["admin"] for s in stats["session_list"] if s["client"] == "ops"] == [True]
        assert stats["errors_by_code"].get("INTERNAL", 0) == 0
        assert proc.poll() is None
    finally:
        stop_daemon(proc)
