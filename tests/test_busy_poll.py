"""The control loop's busy poll: after a reply it watches the socket for ``busy_poll_us``
instead of sleeping on it at once, and it never spins longer than that."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq

from hicache.client import HiCacheClient
from hicache.daemon.server import Daemon
from hicache.daemon.settings import build_parser, resolve
from tests.daemon_helpers import start_daemon, stop_daemon

SMALL = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--device-tokens", "512"]


@pytest.fixture
def daemon(tmp_path):
    args = [*SMALL, "--endpoint", f"ipc://{tmp_path}/d.sock", "--keep-host", "false"]
    d = Daemon(resolve(build_parser().parse_args(args), environ={}))
    yield d
    d.close()


def test_busy_poll_ends_at_its_deadline_and_at_once_when_a_message_waits(daemon):
    t0 = time.perf_counter()
    daemon._busy_poll(t0 + 0.02)  # nothing comes: it watches until the deadline, then returns
    assert time.perf_counter() - t0 >= 0.02
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.connect(daemon.settings.endpoint)
    try:
        peer.send(b"ping")
        t0 = time.perf_counter()
        daemon._busy_poll(t0 + 30.0)  # a message waits: back long before the deadline
        assert time.perf_counter() - t0 < 15.0
        assert daemon._recv_frames()[-1] == b"ping"  # and it is still there to be read
    finally:
        peer.close(linger=0)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_busy_polling_daemon_sleeps_once_requests_stop(tmp_path):
    """With the longest busy poll, a daemon that served a burst uses (almost) no CPU while no
    request comes: it spins after a reply, never in between."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(endpoint, *SMALL, "--busy-poll-us", "10000", "--keep-host", "false")
    try:
        with HiCacheClient(endpoint, name="burst") as hc:
            prompt = np.arange(64, dtype=np.int32)
            hc.insert(prompt, hc.alloc(64))
            for _ in range(50):
                assert hc.match_prefix(prompt, lock=False).device_hit_length == 64
            time.sleep(0.1)  # the last spin (10 ms at most) ends
            before, t0 = _cpu_seconds(proc.pid), time.monotonic()
            time.sleep(1.0)
            used = _cpu_seconds(proc.pid) - before
            assert used < 0.3 * (time.monotonic() - t0), used
    finally:
        stop_daemon(proc)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_peer_slower_than_the_busy_poll_never_makes_the_daemon_spin(tmp_path):
    """Requests 30 ms apart with a 10 ms busy poll: spinning after each reply would burn a
    third of a core; the daemon sees that requests do not come back within a spin and
    sleeps right after its replies."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(endpoint, *SMALL, "--busy-poll-us", "10000", "--keep-host", "false")
    try:
        with HiCacheClient(endpoint, name="slow") as hc:
            prompt = np.arange(64, dtype=np.int32)
            hc.insert(prompt, hc.alloc(64))
            before, t0 = _cpu_seconds(proc.pid), time.monotonic()
            for _ in range(40):
                time.sleep(0.03)  # the peer's pace: slower than the busy poll
                assert hc.match_prefix(prompt, lock=False).device_hit_length == 64
            used = _cpu_seconds(proc.pid) - before
            assert used < 0.15 * (time.monotonic() - t0), used
    finally:
        stop_daemon(proc)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_pairs_of_messages_from_a_slow_peer_never_make_the_daemon_spin(tmp_path):
    """Two messages back to back every 20 ms: the second is queued behind the first, so its
    quick arrival says nothing of the peer's pace; a daemon that learnt from it would spin
    10 ms after every pair (half a core for junk)."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(endpoint, *SMALL, "--busy-poll-us", "10000", "--keep-host", "false")
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.connect(endpoint)
    try:
        before, t0 = _cpu_seconds(proc.pid), time.monotonic()
        for _ in range(60):
            peer.send(b"junk")
            peer.send(b"junk")
            for _ in range(2):  # the two error replies
                assert peer.poll(5000) and peer.recv_multipart()
            time.sleep(0.02)
        used = _cpu_seconds(proc.pid) - before
        assert used < 0.2 * (time.monotonic() - t0), used
    finally:
        peer.close(linger=0)
        stop_daemon(proc)
