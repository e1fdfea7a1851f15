"""An engine trusts only a daemon of a trusted user, and maps only that daemon's segments.

The attacks of the security review (another local user squatting the default folder, the
socket name, a loopback port, an abstract name; a hello naming any file as the pool) are played
here with a second uid where it takes one (as root, as CI runs; skipped otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from hicache.client import HiCacheClient
from hicache.client.trust import (
    UntrustedDaemon,
    peer_uid,
    segment_path,
    trusted_uids,
    verify_endpoint,
)
from hicache.local_tcp import connection_uid, listener_uid
from hicache.memory import attach_shared_memory
from tests.daemon_helpers import start_daemon, stop_daemon
from tests.l3_servers import free_port

OTHER = 4242  # a uid that is neither ours nor root (no passwd entry needed)
ME = trusted_uids()
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user (needs root)")


@contextlib.contextmanager
def shared_scratch():
    """A folder under /tmp that another uid can pass through (tmp_path's parents are 0700)."""
    folder = tempfile.mkdtemp(prefix="hicache-trust-", dir="/tmp")
    os.chmod(folder, 0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def listener_as(uid: int, bind, listen_after_setuid: bool = False):
    """A forked child that binds with ``bind()`` (a socket) and listens, as ``uid`` (or binds
    as root and drops to ``uid`` only before listen(): its socket file stays root's)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python cleanup, no pytest
        try:
            if not listen_after_setuid:
                os.setgid(uid)
                os.setuid(uid)
            sock = bind()
            if listen_after_setuid:
                os.setgid(uid)
                os.setuid(uid)
            sock.listen(8)
            os.write(ready_w, b"1")
            signal.pause()
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1", "the listener did not start"
        yield pid
    finally:
        os.close(ready_r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def unix_listener(path: str):
    def bind():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        return sock

    return bind


# ---- ipc endpoints --------------------------------------------------------------------------
def test_an_abstract_socket_is_refused_before_anything_is_sent():
    with pytest.raises(UntrustedDaemon, match="abstract"):
        verify_endpoint("ipc://@hicache", ME)
    with pytest.raises(UntrustedDaemon, match="abstract"):
        HiCacheClient("ipc://@hicache", timeout_s=1)


@pytest.fixture
def shared_listener(tmp_path):
    """(folder, socket path): a socket listening in a folder of its own (the tests chmod it)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    path = str(folder / "hicache.sock")
    sock = unix_listener(path)()
    sock.listen(1)
    yield folder, path
    sock.close()


@pytest.mark.parametrize("mode", [0o1777, 0o770, 0o777])
def test_a_folder_other_users_can_write_is_refused(shared_listener, mode):
    """Sticky shared folders too (s7): anyone may create the socket's name there first."""
    folder, path = shared_listener
    os.chmod(folder, mode)
    with pytest.raises(UntrustedDaemon, match="writable by other users"):
        verify_endpoint(f"ipc://{path}", ME)
    os.chmod(folder, 0o700)
    assert verify_endpoint(f"ipc://{path}", ME) == os.getuid()


def test_the_cli_refuses_an_untrusted_daemon_in_one_line(shared_listener):
    folder, path = shared_listener
    os.chmod(folder, 0o777)
    for endpoint, says in ((f"ipc://{path}", "writable by other users"),
                           ("ipc://@hicache", "abstract sockets")):  # fmt: skip
        cli = [sys.executable, "-m", "hicache.client.cli", "--endpoint", endpoint, "ping"]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and says in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # no traceback


def test_a_link_in_place_of_the_socket_or_its_folder_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    path = str(real / "d.sock")
    sock = unix_listener(path)()
    sock.listen(1)
    try:
        (tmp_path / "via").symlink_to(real)
        with pytest.raises(UntrustedDaemon, match="not a directory"):
            verify_endpoint(f"ipc://{tmp_path}/via/d.sock", ME)
        os.symlink(path, real / "link.sock")
        with pytest.raises(UntrustedDaemon, match="not a socket"):
            verify_endpoint(f"ipc://{real}/link.sock", ME)
    finally:
        sock.close()


def test_nothing_listening_is_a_timeout_not_a_trust_error(tmp_path):
    from hicache.client import DaemonTimeout

    with pytest.raises(DaemonTimeout, match="no daemon"):
        HiCacheClient(f"ipc://{tmp_path}/none.sock", timeout_s=1)


@root_only
def test_a_daemon_in_a_folder_another_user_made_is_refused_unless_named():
    """s2/s3: another user pre-creates the default folder and serves there."""
    with shared_scratch() as scratch:
        squat = os.path.join(scratch, f"hicache-{os.getuid()}")
        os.mkdir(squat, 0o700)
        os.chown(squat, OTHER, OTHER)
        path = os.path.join(squat, "hicache.sock")
        with listener_as(OTHER, unix_listener(path)):
            with pytest.raises(UntrustedDaemon, match=f"uid {OTHER}"):
                verify_endpoint(f"ipc://{path}", ME)
            with pytest.raises(UntrustedDaemon):
                HiCacheClient(f"ipc://{path}", timeout_s=1)
            named = trusted_uids(environ={"HICACHE_DAEMON_USER": str(OTHER)})
            assert verify_endpoint(f"ipc://{path}", named) == OTHER  # the user it names


@root_only
def test_a_socket_file_of_another_user_is_refused(tmp_path):
    path = str(tmp_path / "d.sock")
    sock = unix_listener(path)()
    sock.listen(1)
    try:
        os.chown(path, OTHER, OTHER)
        with pytest.raises(UntrustedDaemon, match=f"uid {OTHER}"):
            verify_endpoint(f"ipc://{path}", ME)
    finally:
        sock.close()


@root_only
def test_the_process_listening_must_be_trusted_whoever_owns_the_file():
    with shared_scratch() as scratch:
        path = os.path.join(scratch, "d.sock")
        os.chmod(scratch, 0o700)
        with listener_as(OTHER, unix_listener(path), listen_after_setuid=True):
            assert os.lstat(path).st_uid == 0  # the file is root's, the listener is not
            assert peer_uid(path) == OTHER
            with pytest.raises(UntrustedDaemon, match="the process listening there"):
                verify_endpoint(f"ipc://{path}", ME)


# ---- tcp endpoints --------------------------------------------------------------------------
def test_tcp_to_another_host_needs_curve_keys():
    with pytest.raises(UntrustedDaemon, match="CurveZMQ"):
        verify_endpoint("tcp://10.1.2.3:5555", ME)
    assert verify_endpoint("tcp://10.1.2.3:5555", ME, curve=True) is None  # the key proves it


def test_the_owner_of_a_loopback_listener_is_found():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    try:
        port = sock.getsockname()[1]
        assert listener_uid(port) == os.getuid()
        assert verify_endpoint(f"tcp://127.0.0.1:{port}", ME) == os.getuid()
    finally:
        sock.close()
    assert listener_uid(port) is None


def test_the_owner_of_a_loopback_connections_far_end_is_found():
    """What a daemon without keys learns of who connected: the uid of the client's socket
    (the one whose own address is the connection's far end), never the listener's."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    accepted, (host, port) = server.accept()
    try:
        listening = server.getsockname()[1]
        assert connection_uid(host, port, host, listening) == os.getuid()
        assert connection_uid(host, listening, host, port) == os.getuid()  # (the daemon's end)
        assert connection_uid(host, port, host, listening + 1) is None  # connected elsewhere
        assert connection_uid("10.1.2.3", port, host, listening) is None  # not this host's
        assert connection_uid("not an address", port, host, listening) is None
        client.close()  # its process let go: the kernel names nobody (not root) any more
        assert connection_uid(host, port, host, listening) is None
    finally:
        for s in (client, accepted, server):
            s.close()


def test_a_client_on_another_of_this_hosts_addresses_is_found_too():
    """A local user may bind its end to any address of this host (eth0's) and connect to a
    loopback listener: the kernel still names it, so it cannot pass for another host."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # (no packet: picks the address a route would use)
        address = probe.getsockname()[0]
    except OSError:
        address = "127.0.0.1"
    finally:
        probe.close()
    if ipaddress.ip_address(address).is_loopback:
        pytest.skip("this host has no address but loopback ones")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.socket()
    client.bind((address, 0))
    client.connect(server.getsockname())
    accepted, (host, port) = server.accept()
    try:
        assert host == address
        assert connection_uid(host, port, "127.0.0.1", server.getsockname()[1]) == os.getuid()
    finally:
        for s in (client, accepted, server):
            s.close()


@root_only
def test_a_loopback_port_another_user_took_is_refused():
    """s14: the port was taken while the daemon was down."""
    port = free_port()

    def bind():
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        return sock

    with listener_as(OTHER, bind):
        with pytest.raises(UntrustedDaemon, match=f"uid {OTHER}"):
            verify_endpoint(f"tcp://127.0.0.1:{port}", ME)


# ---- the pools a hello names ----------------------------------------------------------------
NAME = f"hicache-{os.getuid()}-1-{'ab' * 16}-device"


@pytest.mark.parametrize(
    "name",
    ["../../etc/passwd", "/etc/passwd", "hicache-0-1-xyz-device", NAME + "/x", "", NAME + "\n"],
)
def test_a_pool_named_outside_the_daemons_form_is_refused(name):
    with pytest.raises(UntrustedDaemon, match="not a hicache segment name"):
        segment_path({"name": name, "path": "/dev/shm/" + NAME}, os.getuid(), ME)


def test_a_pool_path_on_the_wire_is_never_used():
    desc = {"name": NAME, "path": "/etc/shadow"}
    assert segment_path(desc, os.getuid(), ME) == f"/dev/shm/{NAME}"
    other = f"hicache-{OTHER}-1-{'ab' * 16}-device"
    with pytest.raises(UntrustedDaemon, match=f"uid {OTHER}"):
        segment_path({"name": other}, os.getuid(), ME)


@pytest.fixture
def shm_name():
    name = f"hicache-{os.getuid()}-1-{os.urandom(16).hex()}-device"
    yield name
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")


def test_a_planted_link_fifo_or_shared_file_is_not_mapped(tmp_path, shm_name):
    path = f"/dev/shm/{shm_name}"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1024)
    victim.chmod(0o600)  # (a private file of ours: only the link itself gives it away)
    os.symlink(victim, path)
    with pytest.raises(OSError) as refused:
        attach_shared_memory(path, 4096, ME)
    assert refused.value.errno == errno.ELOOP  # the link is not followed
    os.unlink(path)
    os.mkfifo(path, 0o600)
    started = time.monotonic()
    with pytest.raises(PermissionError, match="not a regular file"):
        attach_shared_memory(path, 4096, ME)  # (a FIFO opened for reading would block)
    assert time.monotonic() - started < 5
    os.unlink(path)
    with open(path, "wb") as fh:
        fh.write(bytes(8192))
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="not privately"):
        attach_shared_memory(path, 4096, ME)
    os.chmod(path, 0o600)
    with pytest.raises(PermissionError, match="uid"):
        attach_shared_memory(path, 4096, {OTHER})  # a daemon of another user: not its file
    mm, buf = attach_shared_memory(path, 4096, ME)
    del buf
    mm.close()
    assert victim.read_bytes() == b"precious" * 1024


def test_a_hello_that_names_another_file_maps_nothing(tmp_path):
    """s3: whatever the hello says, the engine maps only the daemon's own segments."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1024)
    ep = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(ep)
    try:
        with HiCacheClient(ep, name="engine") as hc:
            hc.info["pools"]["device"] = {"kind": "shm", "name": "x", "path": str(victim)}
            with pytest.raises(UntrustedDaemon):
                hc.attach()
            assert hc.pools is None
        with HiCacheClient(ep, name="engine") as hc:  # the real hello maps as before
            pools = hc.attach()
            assert pools.device.num_pages > 1 and hc.daemon_uid == os.getuid()
            tokens = np.arange(1, 17, dtype=np.int32)
            hc.insert(tokens, hc.alloc(16))
    finally:
        stop_daemon(proc)
    assert victim.read_bytes() == b"precious" * 1024
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) & 0o022 == 0


def test_without_keys_one_local_user_holds_one_share_of_the_sessions(tmp_path):
    """s10 under --insecure-local-tcp: with no key to tell clients apart, the daemon names
    the local user the kernel lists at the far end of each connection (when it was
    accepted) and holds each to a quarter of max_sessions, over any number of connections.
    The daemon's own user and root are not held to it (they can stop the daemon anyway):
    here the test's user stands for another one."""
    import threading

    import msgpack
    import zmq

    from hicache.daemon.config import build_parser, resolve
    from hicache.daemon.server import Daemon
    from hicache.protocol import PROTOCOL_VERSION, ErrorCode, Op, decode_reply

    ep = f"tcp://127.0.0.1:{free_port()}"
    args = ["--endpoint", ep, "--insecure-local-tcp", "true", "--max-sessions", "128",
            "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
            "--device-tokens", "512", "--keep-host", "false"]  # fmt: skip
    socks = []

    def hellos(connections: int) -> list:
        replies = []
        for _ in range(connections):  # 11 each (16 per connection at most)
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 20000)
            sock.connect(ep)
            socks.append(sock)
            for _ in range(11):
                hello = [PROTOCOL_VERSION, int(Op.HELLO), 1, 0, 0, {"client": "many", "pid": 1}]
                sock.send(msgpack.packb(hello))
                replies.append(decode_reply(sock.recv()))
        return replies

    for trusted in (frozenset(), None):
        daemon = Daemon(resolve(build_parser().parse_args(args), environ={}))
        if trusted is not None:
            daemon.inbox.watch.trusted = trusted  # the test's user: another local user
        serving = threading.Thread(target=daemon.serve)
        serving.start()
        try:
            replies = hellos(3)
            if trusted is None:  # the daemon's own user: only the per-connection bound
                assert all(r.ok for r in replies)
                continue
            assert all(r.ok for r in replies[:32])  # 128 / 4
            refused = replies[32]
            assert refused.status is ErrorCode.QUOTA_EXCEEDED
            assert "this local user holds 32 sessions" in str(refused.fields)
        finally:
            for sock in socks:
                sock.close()
            socks.clear()
            daemon.stopping = True
            serving.join()
            daemon.close()
