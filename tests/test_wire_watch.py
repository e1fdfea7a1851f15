"""What tcp peers make zmq hold unread is bounded (daemon/transport/wire_watch.py): a peer speaking
ZMTP itself that never finishes a message is closed, the largest first when all together hold
too much; what well-behaved clients send never adds up to a false alarm."""

from __future__ import annotations

import errno
import os
import random
import socket
import struct
import time

import pytest
import zmq

from hicache.client import HiCacheClient
from hicache.daemon.observe import END_SEQ, MAX_ASK_BYTES, PEER_SENDS
from hicache.daemon.transport import HANDSHAKE_BYTES, PER_CONNECTION, WireWatch, wire_watch
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until
from tests.l3_servers import free_port


def zmtp_peer(port: int, kind: bytes = b"DEALER") -> socket.socket:
    """A tcp connection that speaks ZMTP 3 (NULL security) as a ``kind`` socket, written by
    hand: zmq itself never sends a message before its last frame."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32))
    _exactly(sock, 64)  # its greeting
    ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(kind)) + kind
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    _, size = _exactly(sock, 2)  # its READY (a short command) ...
    _exactly(sock, size)  # ... read, so that anything more is news
    return sock


def _exactly(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        more = sock.recv(n - len(got))
        assert more, "closed"
        got += more
    return got


def send_unfinished(sock: socket.socket, nbytes: int, frame: int = 1 << 20) -> None:
    """Frames of one message that never ends (each frame says more follow)."""
    chunk = struct.pack(">BQ", 0x03, frame) + bytes(frame)
    for _ in range(nbytes // frame):
        sock.sendall(chunk)


def closed_by_peer(sock: socket.socket, timeout: float = 20.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


@pytest.fixture
def router():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    yield ctx, sock
    ctx.destroy(linger=0)


def _pair(ctx, sock, curve: bool):
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if curve:
        server_pub, server_sec = zmq.curve_keypair()
        client_pub, client_sec = zmq.curve_keypair()
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = server_sec, server_pub, 1
        dealer.curve_secretkey, dealer.curve_publickey = client_sec, client_pub
        dealer.curve_serverkey = server_pub
    watch = WireWatch(sock, curve, "test")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return watch, dealer, port


def _read(sock, watch):
    frames = sock.recv_multipart(copy=False)
    watch.took(frames[0], frames[1:])
    return frames


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_what_reads_took_matches_what_the_kernel_received_to_the_byte(router, curve):
    """Thousands of messages of every frame size class (empty, the 255/256 header edge with and
    without CurveZMQ's 33 bytes, large): what the watch counts unread does not move."""
    ctx, sock = router
    watch, dealer, _ = _pair(ctx, sock, curve)
    dealer.send_multipart([b"hello"])
    _read(sock, watch)
    rnd = random.Random(7)
    sizes = [0, 1, 221, 222, 223, 254, 255, 256, 257, 4096, 70_000]

    def settled():
        time.sleep(0.05)  # (no message in flight: only the kernel's count to settle)
        (held,) = watch.held().values()
        return held

    start = settled()
    assert 0 < start < HANDSHAKE_BYTES  # the greeting and handshake only
    for _ in range(1500):
        dealer.send_multipart([bytes(rnd.choice(sizes)) for _ in range(rnd.randint(1, 4))])
        _read(sock, watch)
    assert settled() == start
    assert watch.check() == 0 and watch.closed == 0
    watch.close()


def test_an_unfinished_message_past_the_bound_closes_its_connection_only(router):
    ctx, sock = router
    watch, dealer, port = _pair(ctx, sock, curve=False)
    watch.per_connection, watch.in_all = 4 << 20, 64 << 20
    dealer.send_multipart([b"hi"])
    _read(sock, watch)
    attacker = zmtp_peer(port)
    send_unfinished(attacker, 2 << 20)  # under the bound: kept
    wait_until(lambda: max(watch.held().values()) > 2 << 20, what="the frames arriving")
    assert watch.check() == 0
    send_unfinished(attacker, 4 << 20)
    wait_until(lambda: max(watch.held().values()) > 5 << 20, what="the frames arriving")
    assert watch.check() == 1 and watch.closed == 1
    assert closed_by_peer(attacker)
    dealer.send_multipart([b"still here"])  # the other connection goes on
    assert _read(sock, watch)[1].bytes == b"still here"
    watch.close()


def test_past_the_bound_for_all_the_largest_go_first(router):
    ctx, sock = router
    watch, dealer, port = _pair(ctx, sock, curve=False)
    watch.per_connection, watch.in_all = 64 << 20, 5 << 20
    small, large, largest = zmtp_peer(port), zmtp_peer(port), zmtp_peer(port)
    for peer, mib in ((small, 1), (large, 2), (largest, 3)):
        send_unfinished(peer, mib << 20)
    wait_until(lambda: sum(watch.held().values()) > 6 << 20, what="the frames arriving")
    assert watch.check() == 1  # 6 MiB > 5: the 3 MiB one goes, 3 MiB are left
    assert closed_by_peer(largest)
    small.settimeout(0.3)
    with pytest.raises(TimeoutError):  # still open
        small.recv(1)
    for peer in (small, large):
        peer.close()
    watch.close()


def test_the_daemon_closes_a_peer_that_never_ends_a_message_and_serves_on():
    pytest.importorskip("prometheus_client")  # (the metrics extra: setup installs it)
    from tests.test_metrics import scrape

    ep, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    proc = start_daemon(ep, "--insecure-local-tcp", "true", "--metrics-port", str(port))
    try:
        with HiCacheClient(ep, name="engine") as hc:
            attacker = zmtp_peer(int(ep.rsplit(":", 1)[1]))
            with pytest.raises(OSError):  # the daemon shuts it down part-way
                send_unfinished(attacker, 8 * PER_CONNECTION, frame=8 << 20)
            assert closed_by_peer(attacker)
            wait_until(lambda: hc.stats()["connections_closed"] == 1, what="the count")
            assert hc.ping()  # the daemon and the other client go on
            wait_until(  # (the scrape's snapshot is refreshed once a second)
                lambda: scrape(port)["hicache_connections_closed_total"][()] == 1,
                what="the metric",
            )
        out = proc.output()
        assert "reset the control connection from 127.0.0.1:" in out
        assert f"{ep} without CurveZMQ (--insecure-local-tcp): every local user" in out
    finally:
        stop_daemon(proc)


def test_event_sockets_close_a_peer_that_sends_past_what_an_ask_needs():
    """Subscriptions and replay asks are small: frames past MAX_ASK_BYTES end the connection
    (zmq), and so do PEER_SENDS bytes of small frames that never end a message (the watch)."""
    ep, pub, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    proc = start_daemon(ep, "--insecure-local-tcp", "true", "--events-endpoint", pub,
                        "--events-replay-endpoint", replay)  # fmt: skip
    port = {name: int(e.rsplit(":", 1)[1]) for name, e in (("pub", pub), ("replay", replay))}
    try:
        with HiCacheClient(ep, name="engine") as hc:
            for name, kind in (("pub", b"SUB"), ("replay", b"DEALER")):
                attacker = zmtp_peer(port[name], kind)
                with pytest.raises(OSError):
                    send_unfinished(attacker, 256 * PEER_SENDS, frame=MAX_ASK_BYTES)
                assert closed_by_peer(attacker)
            wait_until(lambda: hc.stats()["connections_closed"] == 2, what="the count")
            big = zmtp_peer(port["replay"])  # one frame past MAX_ASK_BYTES: zmq's own bound
            send_unfinished(big, MAX_ASK_BYTES + 1, frame=MAX_ASK_BYTES + 1)
            assert closed_by_peer(big)
            asker = zmq.Context.instance().socket(zmq.DEALER)
            asker.setsockopt(zmq.RCVTIMEO, 10_000)
            asker.setsockopt(zmq.LINGER, 0)
            asker.connect(replay)
            asker.send_multipart([b"", (0).to_bytes(8, "big")])  # replay from 0: answered
            assert asker.recv_multipart()[2] == END_SEQ
            asker.close()
        out = proc.output()
        assert "reset the KV event stream connection" in out
        assert "reset the KV event replay connection" in out
    finally:
        stop_daemon(proc)


def test_one_connection_too_many_or_one_that_cannot_be_watched_is_reset(router, monkeypatch):
    ctx, sock = router
    watch, dealer, port = _pair(ctx, sock, curve=False)
    watch.max_connections = 3  # the dealer and two more
    dealer.send_multipart([b"hi"])
    _read(sock, watch)
    kept = [zmtp_peer(port), zmtp_peer(port)]
    watch.check()
    assert watch.closed == 0
    extra = zmtp_peer(port)
    watch.check()
    assert watch.closed == 1 and closed_by_peer(extra)
    kept.pop().close()  # room again: the next one is watched ...
    wait_until(lambda: len(watch.held()) == 2, what="the close seen")

    def no_descriptor(fd):
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as patch:  # ... unless no descriptor is left to watch it with
        patch.setattr(wire_watch.os, "dup", no_descriptor)
        unwatched = zmtp_peer(port)
        watch.check()
    assert watch.closed == 2 and closed_by_peer(unwatched)
    dealer.send_multipart([b"still here"])  # zmq's own descriptors were let go of, not closed
    assert _read(sock, watch)[1].bytes == b"still here"
    for peer in kept:
        peer.close()
    watch.close()


def test_one_local_user_keeps_a_quarter_of_the_connections(router, caplog):
    """A local user (the kernel names who holds the far end of a loopback connection) keeps
    at most a quarter of a socket's connections: holding them all would lock every other
    user's new engines out. A connection it lets go of frees its place."""
    ctx, sock = router
    watch = WireWatch(sock, False, "test", max_connections=16, trusted=frozenset())
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    assert watch.max_per_user == 4
    kept = [zmtp_peer(port) for _ in range(4)]
    watch.check()
    assert watch.closed == 0 and watch._per_uid == {os.getuid(): 4}
    with caplog.at_level("WARNING", logger="hicache.daemon"):
        extra = zmtp_peer(port)
        watch.check()
    assert watch.closed == 1 and closed_by_peer(extra)
    assert f"uid {os.getuid()} holds 4, the most one local user may" in caplog.text
    kept.pop().close()
    wait_until(lambda: len(watch.held()) == 3, what="the close seen")
    assert watch._per_uid == {os.getuid(): 3}
    kept.append(zmtp_peer(port))  # its place is free again
    watch.check()
    assert watch.closed == 1 and len(watch.held()) == 4
    assert {watch.uid_of(fd) for fd in watch.held()} == {os.getuid()}  # (what hellos count to)
    fd = next(iter(watch.held()))
    stale, watch._connections[fd].sock = watch._connections[fd].sock, socket.socket()
    assert watch.uid_of(fd) is None, "a number given to another socket kept its old user"
    watch._connections[fd].sock.close()
    watch._connections[fd].sock = stale
    for peer in kept:
        peer.close()
    watch.close()
    # the daemon's own user (and root) is not held to a share: it can stop the daemon anyway
    ctx2 = zmq.Context()
    sock2 = ctx2.socket(zmq.ROUTER)
    own = WireWatch(sock2, False, "test", max_connections=16)
    port = sock2.bind_to_random_port("tcp://127.0.0.1")
    peers = [zmtp_peer(port) for _ in range(6)]
    own.check()
    assert own.closed == 0 and not own._per_uid and len(own.held()) == 6
    for peer in peers:
        peer.close()
    own.close()
    ctx2.destroy(linger=0)


def test_checks_take_a_bounded_share_of_the_loop(router, monkeypatch):
    ctx, sock = router
    watch, _, _ = _pair(ctx, sock, curve=False)
    clock, checks = [100.0], []

    def slow_check():  # a check of many connections: 0.1 s
        checks.append(clock[0])
        clock[0] += 0.1
        return 0

    monkeypatch.setattr(wire_watch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(watch, "check", slow_check)
    for _ in range(100):
        watch.maybe_check()
        clock[0] += 0.05
    gaps = [b - a for a, b in zip(checks, checks[1:], strict=False)]
    assert len(checks) >= 2 and min(gaps) > 1.99  # 2 s after a 0.1 s check (5%), not 10 ms
    monkeypatch.undo()
    watch.close()


def test_a_failing_watch_never_ends_the_loop(router, monkeypatch, caplog):
    ctx, sock = router
    watch, _, port = _pair(ctx, sock, curve=False)
    gone = os.open(os.devnull, os.O_RDONLY)
    os.close(gone)  # a descriptor zmq closed meanwhile: the reset finds nothing, raises nothing
    watch._reset_unwatched(gone, port, "no descriptor left to watch it")

    def broken(fd, port):
        raise RuntimeError("anything")

    monkeypatch.setattr(watch, "_accepted", broken)
    peer = zmtp_peer(port)
    assert watch.check() == 0  # logged, not raised
    assert "connection watch" in caplog.text
    peer.close()
    watch.close()


def test_the_descriptor_limit_bounds_the_connections_kept(monkeypatch):
    from hicache.daemon.observe import MAX_PEERS
    from hicache.daemon.transport import MAX_CONNECTIONS, SPARE_DESCRIPTORS, connections_allowed

    monkeypatch.setattr(wire_watch.resource, "getrlimit", lambda _: (4096, 4096))
    control, events = (
        connections_allowed(0.5, MAX_CONNECTIONS),
        connections_allowed(0.25, MAX_PEERS),
    )
    assert 0 < control < MAX_CONNECTIONS and 0 < events <= MAX_PEERS
    assert 2 * (control + 2 * events) + SPARE_DESCRIPTORS <= 4096  # two descriptors each
    monkeypatch.setattr(wire_watch.resource, "getrlimit", lambda _: (1 << 20, 1 << 20))
    assert connections_allowed(0.5, MAX_CONNECTIONS) == MAX_CONNECTIONS
