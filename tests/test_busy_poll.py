"""The control loop's busy poll (daemon/transport/busy_poll.py): after a reply it watches the socket
for ``busy_poll_us`` instead of sleeping on it at once, never longer than that, and only while
requests come back that fast."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq

from hicache.client import HiCacheClient
from hicache.daemon.config import build_parser, resolve
from hicache.daemon.server import Daemon
from hicache.daemon.transport import watch
from tests.daemon_helpers import start_daemon, stop_daemon

SMALL = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--device-tokens", "512"]
PROMPT = np.arange(64, dtype=np.int32)
needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")


@pytest.fixture
def daemon(tmp_path):
    args = [*SMALL, "--endpoint", f"ipc://{tmp_path}/d.sock", "--keep-host", "false"]
    d = Daemon(resolve(build_parser().parse_args(args), environ={}))
    yield d
    d.close()


def test_a_watch_ends_at_its_deadline_and_at_once_when_a_message_waits(daemon):
    t0 = time.perf_counter()
    assert not watch(daemon.sock, t0 + 0.02)  # nothing comes: it watches until the deadline
    assert time.perf_counter() - t0 >= 0.02
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.connect(daemon.settings.endpoint)
    try:
        peer.send(b"ping")
        t0 = time.perf_counter()
        assert watch(daemon.sock, t0 + 30.0)  # a message waits: back long before the deadline
        assert time.perf_counter() - t0 < 15.0
        assert daemon.inbox.next()[-1] == b"ping"  # and it is still there to be read
    finally:
        peer.close(linger=0)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def polling_daemon(tmp_path):
    """(endpoint, pid) of a daemon with the longest busy poll (10 ms), a 64-token prompt
    cached."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    proc = start_daemon(endpoint, *SMALL, "--busy-poll-us", "10000", "--keep-host", "false")
    try:
        with HiCacheClient(endpoint, name="setup") as hc:
            hc.insert(PROMPT, hc.alloc(len(PROMPT)))
        yield endpoint, proc.pid
    finally:
        stop_daemon(proc)


def cpu_share(pid: int, traffic: Callable[[], None]) -> float:
    """The daemon's CPU seconds per wall second while ``traffic`` runs."""
    before, t0 = _cpu_seconds(pid), time.monotonic()
    traffic()
    return (_cpu_seconds(pid) - before) / (time.monotonic() - t0)


@needs_proc
def test_a_busy_polling_daemon_sleeps_once_requests_stop(polling_daemon):
    """After a burst the daemon uses (almost) no CPU while no request comes: it spins after a
    reply, never in between."""
    endpoint, pid = polling_daemon
    with HiCacheClient(endpoint, name="burst") as hc:
        for _ in range(50):
            assert hc.match_prefix(PROMPT, lock=False).device_hit_length == 64
        time.sleep(0.1)  # the last spin (10 ms at most) ends
        assert cpu_share(pid, lambda: time.sleep(1.0)) < 0.3


@needs_proc
def test_a_peer_slower_than_the_busy_poll_never_makes_the_daemon_spin(polling_daemon):
    """Requests 30 ms apart: spinning after each reply would burn a third of a core; the daemon
    sees that requests do not come back within a spin and sleeps right after its replies."""
    endpoint, pid = polling_daemon
    with HiCacheClient(endpoint, name="slow") as hc:

        def slow() -> None:
            for _ in range(40):
                time.sleep(0.03)  # the peer's pace: slower than the busy poll
                assert hc.match_prefix(PROMPT, lock=False).device_hit_length == 64

        assert cpu_share(pid, slow) < 0.15


@needs_proc
def test_pairs_of_messages_from_a_slow_peer_never_make_the_daemon_spin(polling_daemon):
    """Two messages back to back every 20 ms: the second is queued behind the first, so its
    quick arrival says nothing of the peer's pace; a daemon that learnt from it would spin
    10 ms after every pair (half a core for junk)."""
    endpoint, pid = polling_daemon
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.connect(endpoint)

    def pairs() -> None:
        for _ in range(60):
            peer.send(b"junk")
            peer.send(b"junk")
            for _ in range(2):  # the two error replies
                assert peer.poll(5000) and peer.recv_multipart()
            time.sleep(0.02)

    try:
        assert cpu_share(pid, pairs) < 0.2
    finally:
        peer.close(linger=0)


@needs_proc
def test_bursts_of_requests_then_a_pause_cost_at_most_a_small_share_of_a_core(polling_daemon):
    """Two or three requests, each sent after the reply to the one before, then 20 ms of quiet:
    each burst teaches that requests come back fast, so the daemon watches after the burst's
    last reply and the watch runs out. Without a bound that costs 10 ms in every 20-26 ms (half
    a core); watches that ran out may take at most WASTE_SHARE of a core over time."""
    endpoint, pid = polling_daemon
    with HiCacheClient(endpoint, name="bursts") as hc:

        def bursts() -> None:
            for n in range(60):
                for _ in range(2 + n % 2):
                    assert hc.match_prefix(PROMPT, lock=False).device_hit_length == 64
                time.sleep(0.02)

        assert cpu_share(pid, bursts) < 0.2


@needs_proc
def test_busy_polling_finds_the_next_request_awake_and_costs_the_watch(tmp_path):
    """What busy polling is for, against the same daemon with it off, in one run: an engine
    whose next request comes 1 ms after each reply finds the polling daemon watching (its
    watches end with a request, not with their deadline); the daemon with it off never
    watches and sleeps instead. (CPU shares are not compared: a spin yields the core, and on a
    busy machine others take it.)"""
    eps = {k: f"ipc://{tmp_path}/{k}.sock" for k in ("poll", "off")}
    procs = {k: start_daemon(ep, *SMALL, "--busy-poll-us", "10000" if k == "poll" else "0",
                             "--keep-host", "false") for k, ep in eps.items()}  # fmt: skip
    try:
        clients = {k: HiCacheClient(ep, name=k, heartbeat=False) for k, ep in eps.items()}
        for hc in clients.values():
            hc.insert(PROMPT, hc.alloc(len(PROMPT)))
        for hc in clients.values():

            def engine(hc: HiCacheClient = hc) -> None:
                for _ in range(150):
                    think = time.perf_counter() + 0.001  # the engine's step between lookups
                    while time.perf_counter() < think:  # (a spin: a sleep would let the CPU idle)
                        pass
                    assert hc.match_prefix(PROMPT, lock=False).device_hit_length == 64

            engine()
        stats = {k: hc.stats() for k, hc in clients.items()}
        assert stats["off"]["busy_poll_watches"] == 0
        poll = stats["poll"]
        hits, watches = poll["busy_poll_hits"], poll["busy_poll_watches"]
        # most requests found the daemon watching, and its watches mostly found a request
        # (a loaded machine may deschedule the engine past a watch now and then)
        assert hits >= 60 and hits >= 0.7 * watches, (hits, watches)
        for hc in clients.values():
            hc.close()
    finally:
        for proc in procs.values():
            stop_daemon(proc)
