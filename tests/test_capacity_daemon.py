"""`hicache capacity` on a live daemon: the estimate is fed by real traffic off the request path,
agrees with the hit ratio the daemon measured at today's size, and plots."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from hicache.client import HiCacheClient
from hicache.protocol import Op
from tests.daemon_helpers import start_daemon, stop_daemon
from tests.optional import require_module

CLI = [sys.executable, "-m", "hicache.client.cli"]


def test_the_estimate_follows_the_traffic_and_agrees_at_todays_size(tmp_path):
    ep = f"ipc://{tmp_path}/cap.sock"
    proc = start_daemon(ep)  # device 256 tokens, host 1024, page 4
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 500, 96).tolist() for _ in range(12)]  # 1152 tokens: > host
    try:
        with HiCacheClient(ep, name="docqa") as hc:
            for i in range(240):
                prompt = docs[rng.integers(len(docs)) if i % 3 else i % 4] + [900 + i % 7] * 8
                m = hc.match_prefix(prompt)
                loaded = hc.load_back(m)
                have = (
                    m.device_indices
                    if loaded is None
                    else np.concatenate([m.device_indices, loaded])
                )
                hc.insert(prompt, np.concatenate([have, hc.alloc(len(prompt) - len(have))]))
                hc.release(m)
            stats = hc.stats()
            report = hc._call(Op.CAPACITY)[0].fields
        est = report["estimator"]
        assert est["requests"] == 240 and report["dropped_requests"] == 0
        assert (report["device_pages"], report["host_pages"]) == (64, 256)
        points = {p["factor"]: p for p in report["points"]}
        assert sorted(points) == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
        totals = [points[f]["total_hit"] for f in sorted(points)]
        assert totals == sorted(totals) and totals[-1] > totals[0]
        asked = stats["hit_device_tokens"] + stats["hit_host_tokens"] + stats["miss_tokens"]
        measured = (stats["hit_device_tokens"] + stats["hit_host_tokens"]) / asked
        assert abs(points[1.0]["total_hit"] - measured) < 0.1, (points[1.0], measured)
        assert "tier" in report["recommendation"]
        text = subprocess.run([*CLI, "--endpoint", ep, "capacity"], capture_output=True,
                              text=True, timeout=60, check=True).stdout  # fmt: skip
        assert "<- today" in text and "recommendation:" in text
        require_module("matplotlib", what="hicache capacity --plot")
        png = tmp_path / "curve.png"
        subprocess.run([*CLI, "--endpoint", ep, "capacity", "--plot", str(png)],
                       capture_output=True, timeout=120, check=True)  # fmt: skip
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        stop_daemon(proc)


def test_the_estimate_says_what_the_disk_adds_and_agrees_with_it(tmp_path):
    """A daemon with a disk under its host pool (admission all) on traffic larger than the
    host pool: the report's disk rows rise with the disk's size, and at today's disk the
    estimate agrees with the hit ratio the daemon measured (disk hits included)."""
    ep = f"ipc://{tmp_path}/capd.sock"
    disk = ["--disk", str(tmp_path / "disk"), "--disk-bytes", "64MiB", "--disk-admission", "all",
            "--l3-model", "m", "--l3-prefetch-policy", "wait_complete"]  # fmt: skip
    proc = start_daemon(ep, *disk)  # device 256 tokens, host 1024, page 4
    rng = np.random.default_rng(6)
    docs = [rng.integers(1, 500, 96).tolist() for _ in range(24)]  # 2304 tokens: 2x the host
    try:
        with HiCacheClient(ep, name="docqa") as hc:
            for i in range(240):
                prompt = docs[rng.integers(len(docs))] + [900 + i % 7] * 8
                m = hc.match_prefix(prompt)
                loaded = hc.load_back(m)
                have = (
                    m.device_indices
                    if loaded is None
                    else np.concatenate([m.device_indices, loaded])
                )
                hc.insert(prompt, np.concatenate([have, hc.alloc(len(prompt) - len(have))]))
                hc.release(m)
            stats = hc.stats()
            report = hc._call(Op.CAPACITY)[0].fields
        assert report["disk_pages"] == stats["l3"]["store_disk_slots"] > 0
        rows = {p["factor"]: p for p in report["disk_points"]}
        assert sorted(rows) == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
        assert rows[1.0]["disk_pages"] == report["disk_pages"]
        totals = [rows[f]["total_hit"] for f in sorted(rows)]
        host_only = {p["factor"]: p for p in report["points"]}[1.0]["total_hit"]
        assert totals == sorted(totals) and totals[0] > host_only  # the disk adds
        asked = stats["hit_device_tokens"] + stats["hit_host_tokens"] + stats["miss_tokens"]
        measured = (stats["hit_device_tokens"] + stats["hit_host_tokens"]) / asked
        assert stats["l3"]["adopted_pages"] > 0
        assert abs(rows[1.0]["total_hit"] - measured) < 0.1, (rows[1.0], measured, host_only)
        text = subprocess.run([*CLI, "--endpoint", ep, "capacity"], capture_output=True,
                              text=True, timeout=60, check=True).stdout  # fmt: skip
        assert "# Disk" in text and f"disk_pages:{report['disk_pages']}" in text
    finally:
        stop_daemon(proc)


def test_no_recommendation_before_the_traffic_could_fill_the_host_pool(tmp_path):
    """Until the page accesses counted reach today's host pool's pages (a daemon just started
    or restarted), every point is cold misses: the report recommends nothing and says why."""
    from hicache.client.capacity_view import render_capacity

    ep = f"ipc://{tmp_path}/capw.sock"
    proc = start_daemon(ep)  # host 1024 tokens: 256 pages of 4
    rng = np.random.default_rng(7)
    try:
        with HiCacheClient(ep, name="warming") as hc:

            def serve(n: int) -> dict:
                for _ in range(n):
                    prompt = rng.integers(1, 500, 40).tolist()  # 10 pages
                    m = hc.match_prefix(prompt)
                    hc.insert(prompt, hc.alloc(len(prompt)))
                    hc.release(m)
                return hc._call(Op.CAPACITY)[0].fields

            cold = serve(20)  # 200 page accesses
            assert cold["accesses_needed"] == 256 and cold["estimator"]["accesses"] == 200
            assert cold["recommendation"] == ""
            assert "none yet: 200 page accesses counted, 256 needed" in render_capacity(cold)
            warm = serve(6)
            assert warm["estimator"]["accesses"] == 260 and "tier" in warm["recommendation"]
            assert "none yet" not in render_capacity(warm)
    finally:
        stop_daemon(proc)


def test_a_fresh_daemon_reports_no_traffic(tmp_path):
    ep = f"ipc://{tmp_path}/cap0.sock"
    proc = start_daemon(ep)
    try:
        out = json.loads(subprocess.run([*CLI, "--endpoint", ep, "capacity", "--json"],
                                        capture_output=True, text=True, timeout=60,
                                        check=True).stdout)  # fmt: skip
        assert out["estimator"]["requests"] == 0 and out["recommendation"] == ""
        text = subprocess.run([*CLI, "--endpoint", ep, "capacity"], capture_output=True,
                              text=True, timeout=60, check=True).stdout  # fmt: skip
        assert "recommendation:no traffic seen yet" in text
    finally:
        stop_daemon(proc)


def test_the_feed_holds_a_bounded_number_of_token_bytes():
    """Under a flood the feed keeps the newest prompts within MAX_PENDING_BYTES (each noted
    request keeps its tokens alive: unbounded, long prompts pile up hundreds of MiB)."""
    from hicache.daemon.requests import capacity_feed

    feed = capacity_feed.CapacityFeed(page_size=16, device_pages=64, host_pages=128)
    prompt = np.arange(4096, dtype=np.int32).tobytes()  # 16 KiB
    fit = capacity_feed.MAX_PENDING_BYTES // len(prompt)
    for i in range(fit + 10):
        feed.saw(True, prompt[: len(prompt) - 4 * (i % 2)], None)  # 2 sizes
        assert feed.pending_bytes <= capacity_feed.MAX_PENDING_BYTES
        assert feed.pending_bytes == sum(len(t) for _, t, _ in feed.pending)
    assert feed.dropped >= 10 and len(feed.pending) + feed.dropped == fit + 10
    kept, dropped = len(feed.pending), feed.dropped
    feed.saw(False, np.zeros(capacity_feed.MAX_PENDING_BYTES, np.int32), None)  # too big alone
    assert len(feed.pending) == kept and feed.dropped == dropped + 1
    feed.saw(False, memoryview(prompt), "ns")  # (the oldest one makes room)
    assert len(feed.pending) == kept and feed.dropped == dropped + 2
    assert feed.run(budget_s=10.0) == kept
    assert feed.pending_bytes == 0 and not feed.pending


def test_the_feed_never_pins_a_request_frame_and_forgets_namespaces():
    """A noted slice of a large frame is copied (a view would keep the whole frame alive past
    the byte bound); the namespace seeds are bounded too (clients invent namespaces)."""
    from hicache.daemon.requests import capacity_feed

    feed = capacity_feed.CapacityFeed(page_size=16, device_pages=64, host_pages=128)
    frame = np.zeros(1 << 20, dtype=np.int32)  # a 4 MiB request frame
    feed.saw(False, frame[:64], None)
    feed.saw(True, memoryview(frame)[:32], None)
    kept = [t for _, t, _ in feed.pending]
    assert all(type(t) is bytes for t in kept) and feed.pending_bytes == 64 * 4 + 32 * 4
    for i in range(capacity_feed.MAX_SEEDS + 10):
        feed.saw(True, frame[:16].tobytes(), f"ns-{i}")
        feed.run(budget_s=10.0)
    assert len(feed._seeds) <= capacity_feed.MAX_SEEDS
