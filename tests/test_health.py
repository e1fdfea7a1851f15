"""Health and drain: /healthz and /readyz on the metrics port, `hicache health`, and SIGTERM
draining (not ready, new sessions refused with DRAINING, sessions told, exit once nothing is
held or at --shutdown-timeout); logs one line per event, JSON with --log-json."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from hicache.client import HiCacheClient
from hicache.client.connection import DaemonError
from hicache.protocol import ErrorCode
from tests.daemon_helpers import start_daemon, stop_daemon, wait_until
from tests.l3_servers import free_port


def probe(port: int, path: str) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code


def health(endpoint: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hicache.client.cli", "--endpoint", endpoint, "health", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sigterm_drains_until_the_last_holder_lets_go(tmp_path):
    ep, port = f"ipc://{tmp_path}/h.sock", free_port()
    proc = start_daemon(ep, "--metrics-port", str(port), "--shutdown-timeout", "60", lease=2.0)
    try:
        assert probe(port, "/healthz") == 200 and probe(port, "/readyz") == 200
        assert probe(port, "/nothing") == 404
        ready = health(ep)
        assert ready.returncode == 0 and "status:ready" in ready.stdout
        engine = HiCacheClient(ep, name="engine")
        tokens = np.arange(1, 33, dtype=np.int32)
        engine.insert(tokens, engine.alloc(len(tokens)))
        held = engine.match_prefix(tokens)  # a lock: the drain waits for it
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: probe(port, "/readyz") == 503, what="not ready")
        assert probe(port, "/healthz") == 200  # alive all the same
        with pytest.raises(DaemonError) as refused:
            HiCacheClient(ep, name="late")
        assert refused.value.code is ErrorCode.DRAINING
        draining = health(ep)
        assert draining.returncode == 1 and "status:draining" in draining.stdout
        assert health(ep, "--live").returncode == 0
        wait_until(lambda: engine.draining, what="the session told")  # by its heartbeat
        m = engine.match_prefix(tokens)  # still served while it finishes its work
        assert m.device_hit_length == len(tokens)
        assert proc.poll() is None  # two locks held: still draining
        engine.release(m, held)
        engine.close()
        proc.wait(timeout=30)  # exits once nothing is held, long before the 60 s timeout
        assert proc.returncode == 0
        out = proc.output()
        assert "drained" in out and "shutdown timeout" not in out
    finally:
        stop_daemon(proc)


def test_the_shutdown_timeout_bounds_a_drain_a_holder_never_ends(tmp_path):
    ep = f"ipc://{tmp_path}/t.sock"
    proc = start_daemon(ep, "--shutdown-timeout", "1", lease=30.0)
    try:
        stuck = HiCacheClient(ep, name="stuck")
        stuck.alloc(16)  # owned pages it never gives back
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        took = time.monotonic() - t0
        assert proc.returncode == 0 and 1.0 <= took < 15, took
        assert "shutdown timeout: 1 sessions" in proc.output()
        stuck.close()
    finally:
        stop_daemon(proc)


def test_a_second_sigterm_stops_at_once(tmp_path):
    ep = f"ipc://{tmp_path}/s.sock"
    proc = start_daemon(ep, "--shutdown-timeout", "600")
    try:
        stuck = HiCacheClient(ep, name="stuck")
        stuck.alloc(16)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: health(ep).returncode == 1, what="draining")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        assert proc.returncode == 0
        stuck.close()
    finally:
        stop_daemon(proc)


def test_no_daemon_is_not_healthy(tmp_path):
    out = health(f"ipc://{tmp_path}/none.sock", "--live")
    assert out.returncode == 1 and "no daemon" in out.stderr


def test_log_json_writes_one_object_per_line(tmp_path):
    ep = f"ipc://{tmp_path}/j.sock"
    proc = start_daemon(ep, "--log-json", "--shutdown-timeout", "5")
    try:
        with HiCacheClient(ep, name="engine") as hc:
            hc.alloc(8)
    finally:
        out = stop_daemon(proc)
    logs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert any(rec["msg"].startswith("drained") and rec["level"] == "INFO" for rec in logs)
    assert all({"ts", "level", "logger", "msg"} <= set(rec) for rec in logs)
    assert not [line for line in out.splitlines() if "Traceback" in line]
