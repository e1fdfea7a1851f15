"""Prometheus metrics (daemon/observe/metrics.py): a scrape shows what the daemon did, under names
that follow Prometheus' rules, from a snapshot the control loop publishes."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest

from tests.optional import require_module

prometheus = require_module("prometheus_client", "prometheus-client", "the /metrics endpoint")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hicache.client import HiCacheClient  # noqa: E402
from tests.daemon_helpers import start_daemon, stop_daemon  # noqa: E402
from tests.l3_servers import free_port  # noqa: E402

SHAPE = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--page-size", "4",
         "--device-tokens", "256", "--host-tokens", "512"]  # fmt: skip


def scrape(port: int) -> dict[str, dict]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def hc_stats(ep: str) -> dict:
    with HiCacheClient(ep, name="operator") as hc:
        return hc.stats()


def test_a_scrape_shows_hits_capacity_and_the_third_tier_under_prometheus_names(tmp_path):
    ep, port = f"ipc://{tmp_path}/m.sock", free_port()
    flags = ["--metrics-port", str(port), "--l3", "memory://metrics", "--l3-model", "m"]
    proc = start_daemon(ep, *SHAPE, *flags)
    try:
        with HiCacheClient(ep, name="engine") as hc:
            tokens = np.arange(1, 41, dtype=np.int32)
            hc.insert(tokens, hc.alloc(40))
            hc.release(hc.match_prefix(tokens))
            with pytest.raises(Exception, match="NOT_OWNED|not owned"):
                hc.free(hc.match_prefix(tokens, lock=False).device_indices)  # the tree's pages
            deadline = time.monotonic() + 10
            while True:  # the snapshot is refreshed about once a second
                m = scrape(port)
                if m.get("hicache_query_tokens_total", {}).get((), 0) >= 80:  # two matches
                    break
                assert time.monotonic() < deadline, m
                time.sleep(0.1)
        assert m["hicache_hit_tokens_total"][(("tier", "device"),)] == 80
        assert m["hicache_capacity_tokens"][(("tier", "device"),)] == 256
        assert m["hicache_capacity_tokens"][(("tier", "host"),)] == 512
        assert m["hicache_sessions"][()] >= 1
        assert "hicache_l3_written_bytes_total" in m and "hicache_l3_breaker_open" in m
        assert m["hicache_request_duration_seconds_count"][(("op", "match"),)] >= 1
        assert m["hicache_request_duration_seconds_bucket"][(("le", "+Inf"), ("op", "insert"))] >= 1
        assert m["hicache_request_errors_total"][(("code", "NOT_OWNED"),)] == 1
        # the cycle collector's pauses: timed from the start (a full one ran there at least)
        stats = hc_stats(ep)
        assert stats["gc_frozen_objects"] > 50_000  # torch's, numpy's, ...: out of its sight
        assert m["hicache_gc_collections_total"][()] >= 1
        assert 0 < m["hicache_gc_pause_seconds_max"][()] <= m["hicache_gc_pause_seconds_total"][()]
        assert m["hicache_gc_frozen_objects"][()] == stats["gc_frozen_objects"]
        for name in m:  # prefix, and _total exactly on counters (the parser adds it back)
            assert name.startswith("hicache_"), name
            assert not name.endswith("_total_total")
    finally:
        stop_daemon(proc)


def test_metrics_settings_are_checked_and_a_busy_port_is_one_clear_line(tmp_path):
    import socket

    from hicache.daemon.config import build_parser, resolve

    with pytest.raises(ValueError, match="metrics_port"):
        resolve(build_parser().parse_args(["--metrics-port", "70000"]), {})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="cannot serve metrics"):
            start_daemon(f"ipc://{tmp_path}/b.sock", *SHAPE, "--metrics-port", str(port))


def test_copies_leases_events_and_the_capacity_estimate_are_scraped(tmp_path):
    """A workload with backups, loads and a session whose lease runs out: the histograms of
    copies by direction, lapsed leases, published event batches and the estimate show it,
    equal to the daemon's own stats."""
    from tests.daemon_helpers import serve_chats, wait_until
    from tests.daemon_helpers import start_daemon as small_daemon

    ep, port = f"ipc://{tmp_path}/c.sock", free_port()
    events = f"ipc://{tmp_path}/events.sock"
    proc = small_daemon(ep, "--metrics-port", str(port), "--events-endpoint", events, lease=0.5)
    try:
        serve_chats(ep, 7, 60)
        lapsed = HiCacheClient(ep, name="lapsed", heartbeat=False)
        lapsed.alloc(8)
        with HiCacheClient(ep, name="check") as hc:
            wait_until(lambda: hc.stats()["leases_expired"] == 1, what="a lease ran out")
            wait_until(lambda: hc.stats()["inflight_transfers"] == 0, what="copies landed")
            stats = hc.stats()

            def scraped() -> dict:
                m = scrape(port)
                if m.get("hicache_leases_expired_total", {}).get((), 0) == 1:
                    return m
                return {}

            wait_until(lambda: scraped(), what="a snapshot with the lapsed lease")
            m = scraped()
        for way, tokens in (("backup", "backup_tokens"), ("load", "load_tokens")):
            label = (("direction", way),)
            assert m["hicache_transfer_duration_seconds_count"][label] >= 1
            size = m["hicache_transfer_size_bytes_sum"][label]
            assert size == stats[tokens] * stats["token_bytes"] > 0
        evicted = m["hicache_evicted_bytes_total"][(("tier", "device"),)]
        assert evicted == stats["evicted_device_tokens"] * stats["token_bytes"] > 0
        assert m["hicache_event_batches_published_total"][()] >= 1
        assert m["hicache_event_batches_dropped_total"][()] == 0
        est = m["hicache_estimated_hit_ratio"]
        assert set(est) >= {
            (("factor", "1"), ("tier", "total")),
            (("factor", "8"), ("tier", "device")),
        }
        assert all(0 <= v <= 1 for v in est.values())
        lapsed.close()
    finally:
        stop_daemon(proc)
