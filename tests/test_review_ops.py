"""Review of the operability features (KV events, metrics, health, drain, logs, CLI): each test
is a defect found by a hostile client, operator or router, written as the behaviour the README
and docs/design.md promise."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from hicache.client import HiCacheClient
from hicache.daemon import launch
from hicache.daemon.observe import END_SEQ
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until
from tests.l3_servers import free_port

SHAPE = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "4", "--page-size", "4"]


def _segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/hicache-*-{pid}-*")


def _drop_segments(pid: int) -> None:
    for path in _segments(pid):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# ---- logs ---------------------------------------------------------------------------------------
def test_log_json_stays_json_when_a_scraper_hangs_up_mid_reply(tmp_path):
    """--log-json promises one JSON object per line; a scraper that resets its connection
    before reading /metrics (a Prometheus scrape timeout) makes socketserver print a raw
    multi-line traceback to stderr."""
    ep, port = f"ipc://{tmp_path}/j.sock", free_port()
    proc = start_daemon(ep, "--metrics-port", str(port), "--log-json")
    try:
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # RST before the reply is written
        with HiCacheClient(ep, name="x") as hc:  # a few housekeeping passes later
            hc.ping()
    finally:
        out = stop_daemon(proc)
    plain = ("hicache-daemon ", "metrics on ")
    bad = []
    for line in out.splitlines():
        if line.startswith(plain):
            continue
        try:
            json.loads(line)
        except ValueError:
            bad.append(line)
    assert not bad, "\n".join(bad[:8])


# ---- KV events: the replay/dump socket ----------------------------------------------------------
def test_a_burst_of_dump_requests_does_not_stall_the_control_loop(tmp_path):
    """Anyone who can reach the replay port can send b"dump" many times: each request makes the
    control thread walk the whole tree again, back to back, while no engine is served (and
    /healthz goes 503 past 10 s). One walk per housekeeping pass would serve them all."""
    ep = f"ipc://{tmp_path}/d.sock"
    pub, rep = f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/rep.sock"
    proc = launch.start_daemon(
        ep,
        *SHAPE[:6],
        "--page-size", "1", "--device-tokens", "200000", "--host-tokens", "0",
        "--keep-host", "false", "--shutdown-timeout", "0",
        "--events-endpoint", pub, "--events-replay-endpoint", rep,
    )  # fmt: skip
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        rng = np.random.default_rng(0)
        with HiCacheClient(ep, name="w") as hc:
            for _ in range(1500):  # a tree of a few thousand nodes
                prompt = [1, 2, 3, *rng.integers(0, 50, 40).tolist()]
                hc.insert(prompt, hc.alloc(len(prompt)))
            peer.connect(rep)
            for _ in range(400):
                peer.send_multipart([b"", b"dump"])
            worst = 0.0
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                hc.ping()
                worst = max(worst, time.monotonic() - t0)
        assert worst < 2.0, f"a ping waited {worst:.1f} s behind dump requests"
    finally:
        peer.close()
        stop_daemon(proc)


def test_a_dump_before_an_engine_registered_is_answered(tmp_path):
    """A --device-tier engine daemon has no cache until the first engine registers: a router
    that starts first and asks for a dump gets no answer at all (not even the end marker) until
    some engine registers, while replay requests are answered at once."""
    ep = f"ipc://{tmp_path}/e.sock"
    pub, rep = f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/rep.sock"
    proc = start_daemon(
        ep, "--device-tier", "engine", "--host-bytes", "4MiB",
        "--events-endpoint", pub, "--events-replay-endpoint", rep,
    )  # fmt: skip
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        peer.connect(rep)
        peer.send_multipart([b"", b"dump"])
        try:
            frames = peer.recv_multipart()
        except zmq.Again:
            pytest.fail("a dump request got no answer in 5 s (no engine registered yet)")
        assert frames[-2] == END_SEQ and frames[-1] == b""  # nothing held: just the end marker
    finally:
        peer.close()
        stop_daemon(proc)


# ---- start-up: misconfigurations and clean-up ----------------------------------------------------
def _refused_in_one_line(endpoint: str, *flags: str) -> None:
    """The daemon must not start with ``flags``: exit 2 and one line saying why."""
    try:
        proc = launch.start_daemon(endpoint, *SHAPE, "--keep-host", "false", *flags)
    except RuntimeError as exc:  # it did not start: what it printed follows the colon
        printed = str(exc).split("): ", 1)[1].strip()
        assert "(exit 2)" in str(exc) and len(printed.splitlines()) == 1, str(exc)
        return
    stop_daemon(proc)
    pytest.fail(f"started with {flags}")


@pytest.mark.parametrize("which", ["--events-endpoint", "--events-replay-endpoint"])
def test_an_event_socket_on_the_daemons_own_ipc_path_is_refused(tmp_path, which):
    """zmq's ipc bind replaces an existing socket file: an event socket on the daemon's own
    endpoint takes the path over, the daemon says ready, and no engine can ever reach it
    (HELLO times out). It should be refused at start with one line (exit 2)."""
    ep = f"ipc://{tmp_path}/d.sock"
    flags = ["--events-endpoint", ep]
    if which == "--events-replay-endpoint":
        flags = ["--events-endpoint", f"ipc://{tmp_path}/pub.sock", which, ep]
    _refused_in_one_line(ep, "--device-tokens", "256", "--host-tokens", "1024", *flags)


def test_the_publisher_and_the_replay_socket_cannot_share_an_ipc_path(tmp_path):
    """The second bind takes the path over: subscribers of the PUB path reach the ROUTER."""
    ep, path = f"ipc://{tmp_path}/d.sock", f"ipc://{tmp_path}/ev.sock"
    _refused_in_one_line(
        ep, "--device-tokens", "256", "--host-tokens", "1024",
        "--events-endpoint", path, "--events-replay-endpoint", path,
    )  # fmt: skip


def test_a_failed_start_leaves_no_shared_memory_and_says_one_line(tmp_path):
    """README: a busy tcp port is refused with one line (exit 2) and a failed start leaves
    nothing behind. With the default --keep-host, a busy metrics port (the last thing a start
    does) logs "host tier kept for the next daemon" and leaves the whole host segment in
    /dev/shm, spared by other daemons' clean-ups for a day."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ep = f"ipc://{tmp_path}/d.sock"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "hicache.daemon", "--endpoint", ep, *SHAPE,
            "--device-tokens", "256", "--host-tokens", "65536",
            "--metrics-port", str(busy.getsockname()[1]),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    _, stderr = proc.communicate(timeout=60)
    busy.close()
    left = _segments(proc.pid)
    _drop_segments(proc.pid)
    assert proc.returncode == 2
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert not left, left
    assert not os.path.exists(f"{tmp_path}/d.sock.snapshot")


def test_sigterm_during_start_up_cleans_up(tmp_path):
    """README: SIGTERM drains, SIGINT stops; both clean up. The handlers are installed only
    once the pools exist, so a SIGTERM while a large pool is being made (a pod deleted during a
    rollout) kills the process by default: its segments, socket and admin token stay."""
    ep = f"ipc://{tmp_path}/d.sock"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "hicache.daemon", "--endpoint", ep, *SHAPE,
            "--device-tokens", "4000000", "--host-tokens", "8000000", "--keep-host", "false",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not glob.glob(f"/dev/shm/hicache-*-{proc.pid}-*-device"):  # the pools are made now
            assert proc.poll() is None and time.monotonic() < deadline, "no device segment"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        left = _segments(proc.pid)
        files = sorted(os.listdir(tmp_path))
        assert not left, f"exit {proc.returncode}; left in /dev/shm: {left}"
        assert "d.sock" not in files and "d.sock.admin" not in files, files
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _drop_segments(proc.pid)


# ---- drain -------------------------------------------------------------------------------------
def test_a_drain_answers_matches_parked_for_the_third_tier(tmp_path):
    """SIGTERM drains "until no engine holds pages or locks": a match parked while the third
    tier fetches holds nothing yet, so the daemon exits at once and that engine's call is never
    answered (it waits out its own timeout). A drain should answer it (a miss will do) first."""
    ep = f"ipc://{tmp_path}/l.sock"
    proc = start_daemon(
        ep,
        "--l3", "memory://review-hang?latency_s=30", "--l3-model", "m",
        "--l3-segment-bytes", "32MiB", "--l3-prefetch-policy", "wait_complete",
        "--shutdown-timeout", "10",
    )  # fmt: skip
    outcome: dict[str, str] = {}
    try:
        with HiCacheClient(ep, name="engine", timeout_s=12) as hc:
            first = np.arange(1, 73, dtype=np.int32)
            hc.insert(first, hc.alloc(len(first)))  # its store write now sleeps in the store
            wait_until(lambda: hc.stats()["l3"]["queued_pages"] > 0, what="a write queued")

            def match() -> None:
                t0 = time.monotonic()
                try:
                    hc.release(hc.match_prefix(np.arange(500, 572, dtype=np.int32)))
                    outcome["result"] = "answered"
                except Exception as exc:  # noqa: BLE001
                    outcome["result"] = f"{type(exc).__name__}: {exc}"
                outcome["took"] = f"{time.monotonic() - t0:.1f}"

            waiter = threading.Thread(target=match)
            waiter.start()
            wait_until(lambda: hc.stats()["l3"]["fetches_in_flight"] > 0, what="a fetch")
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            waiter.join(timeout=40)
            waited = time.monotonic() - signalled
        # answered (a miss will do) before the daemon exited, well before the call's own
        # 12 s timeout or the store's 30 s
        assert outcome.get("result") == "answered", outcome
        assert float(outcome["took"]) < 10 and waited < 10, (outcome, waited)
    finally:
        stop_daemon(proc)


# ---- KV events: order inside a batch ---------------------------------------------------------
def test_removals_name_children_before_their_parents():
    """docs: take() returns "removals first (deepest first)". Within one node the hashes of a
    BlockRemoved are in token order, so a parent block is removed while its children on the
    same medium are still held (a router that prunes subtrees, or insists on leaves, breaks)."""
    import torch  # noqa: F401  (the cache's pools)

    from hicache import HiCacheConfig, HiRadixCache
    from hicache.observe import TierEvents
    from hicache.transfers import ManualTransferEngine
    from tests.event_model import TierModel

    cfg = HiCacheConfig(
        num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32", page_size=1,
        device_tokens=24, host_tokens=0, load_back_threshold=0,
    )  # fmt: skip
    cache = HiRadixCache(cfg, transfer_engine=ManualTransferEngine)
    cache.attach_events(TierEvents(1))
    router = TierModel()
    try:
        cache.insert(np.array([0, 0, 0], np.int32), cache.alloc(3))
        for event in cache.events.take():
            router.apply(event)
        cache.evict(3)
        removed = 0
        for event in cache.events.take():
            if type(event).__name__ == "BlockRemoved":
                removed += len(event.block_hashes)
                gone = list(event.block_hashes)
                tier = router.blocks[event.medium]
                for i, h in enumerate(gone):
                    later = set(gone[i + 1 :])
                    kids = [k for k, (parent, _) in tier.items() if parent == h and k in later]
                    assert not kids, f"block {h} removed before its child {kids[0]}"
            router.apply(event)
        assert removed == 3  # every block was removed (and checked), none is left
        assert not router.blocks.get("GPU")
    finally:
        cache.close()


# ---- CLI -----------------------------------------------------------------------------------------
NEGATIVE = [["top", "-i", "-1", "-n", "2"], ["stats", "--watch", "-1", "-n", "2"]]


@pytest.mark.parametrize("argv", NEGATIVE)
def test_a_negative_interval_is_a_usage_error_not_a_traceback(tmp_path, argv):
    ep = f"ipc://{tmp_path}/c.sock"
    proc = start_daemon(ep)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hicache.client.cli", "--endpoint", ep, *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stop_daemon(proc)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2
