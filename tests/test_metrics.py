"""Prometheus metrics (daemon/metrics.py): a scrape shows what the daemon did, under names
that follow Prometheus' rules, from a snapshot the control loop publishes."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest

prometheus = pytest.importorskip("prometheus_client")

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
        for name in m:  # prefix, and _total exactly on counters (the parser adds it back)
            assert name.startswith("hicache_"), name
            assert not name.endswith("_total_total")
    finally:
        stop_daemon(proc)


def test_metrics_settings_are_checked_and_a_busy_port_is_one_clear_line(tmp_path):
    import socket

    from hicache.daemon.settings import build_parser, resolve

    with pytest.raises(ValueError, match="metrics_port"):
        resolve(build_parser().parse_args(["--metrics-port", "70000"]), {})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="cannot serve metrics"):
            start_daemon(f"ipc://{tmp_path}/b.sock", *SHAPE, "--metrics-port", str(port))
