"""Prometheus metrics: ``hicache-daemon --metrics-port N`` serves ``/metrics`` (on loopback
unless ``--metrics-host`` says otherwise; off by default).

The control loop publishes a snapshot of its stats about once a second (``publish``, from
housekeeping); prometheus-client's HTTP thread renders the latest snapshot and never touches
the cache, so a scrape can neither stall the loop nor race it, and the hot path pays nothing.
Names follow Prometheus conventions: prefix ``hicache_``, base units, ``_total`` counters,
tiers as a label; ratios are left to PromQL (``rate(hit) / rate(query)``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from hicache.daemon.request_stats import BUCKETS

# (name, help, stats key) of plain counters
COUNTERS = [
    ("backup_tokens", "tokens copied from the device to the host tier", "backup_tokens"),
    ("backup_bytes", "bytes copied from the device to the host tier", "backup_bytes"),
    ("load_tokens", "tokens loaded back from the host to the device tier", "load_tokens"),
    ("load_bytes", "bytes loaded back from the host to the device tier", "load_bytes"),
    ("backup_failed_tokens", "tokens whose backup failed or found no room", "backup_failed_tokens"),
    ("transfer_errors", "copies between the tiers that failed", "transfer_errors"),
    ("replies_dropped", "replies dropped because a peer did not read", "replies_dropped"),
]
L3_COUNTERS = [
    ("l3_read_bytes", "bytes read from the third tier and verified", "read_bytes"),
    ("l3_written_bytes", "bytes written to the third tier", "written_bytes"),
    ("l3_lookup_pages", "pages asked of the third tier", "lookup_pages"),
    ("l3_hit_pages", "pages the third tier had", "hit_pages"),
    ("l3_dropped_pages", "writes to the third tier dropped: queue full", "dropped_pages"),
    ("l3_corrupt_pages", "values from the third tier that failed to verify", "corrupt_pages"),
    ("l3_errors", "third-tier jobs that failed as a whole", "errors"),
    (
        "l3_wait_timeouts",
        "matches answered at their bound before their fetch ended",
        "wait_timeouts",
    ),
]


def families(stats: dict[str, Any]) -> Iterator[Any]:
    """The metric families of one stats snapshot (``{}``: nothing yet)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    if not stats:
        return
    hits = CounterMetricFamily(
        "hicache_hit_tokens", "prompt tokens found cached, by tier", labels=["tier"]
    )
    hits.add_metric(["device"], stats.get("hit_device_tokens", 0))
    hits.add_metric(["host"], stats.get("hit_host_tokens", 0))
    yield hits
    queried = stats.get("hit_device_tokens", 0) + stats.get("hit_host_tokens", 0)
    queried += stats.get("miss_tokens", 0)
    yield CounterMetricFamily("hicache_query_tokens", "prompt tokens matched", value=queried)
    capacity = GaugeMetricFamily("hicache_capacity_tokens", "tokens a tier holds", labels=["tier"])
    used = GaugeMetricFamily("hicache_cached_tokens", "tokens cached in a tier", labels=["tier"])
    for tier in ("device", "host"):
        capacity.add_metric([tier], stats.get(f"{tier}_capacity_tokens", 0))
        used.add_metric([tier], stats.get(f"{tier}_cached_tokens", 0))
    yield capacity
    yield used
    for name, key in (
        ("protected", "device_protected_tokens"),
        ("evictable", "device_evictable_tokens"),
    ):
        yield GaugeMetricFamily(
            f"hicache_device_{name}_tokens", f"device tokens {name} now", value=stats.get(key, 0)
        )
    evicted = CounterMetricFamily(
        "hicache_evicted_tokens", "tokens evicted, by tier", labels=["tier"]
    )
    evicted.add_metric(["device"], stats.get("evicted_device_tokens", 0))
    evicted.add_metric(["host"], stats.get("evicted_host_tokens", 0))
    yield evicted
    for name, help_, key in COUNTERS:
        yield CounterMetricFamily(f"hicache_{name}", help_, value=stats.get(key, 0))
    yield GaugeMetricFamily("hicache_sessions", "engine sessions", value=stats.get("sessions", 0))
    yield GaugeMetricFamily(
        "hicache_transfers_in_flight",
        "copies between tiers running",
        value=stats.get("inflight_transfers", 0),
    )
    errors = CounterMetricFamily(
        "hicache_request_errors", "error replies, by error code", labels=["code"]
    )
    for code, n in sorted(stats.get("errors_by_code", {}).items()):
        errors.add_metric([code], n)
    yield errors
    latency = HistogramMetricFamily(
        "hicache_request_duration_seconds", "time to handle a request, by op", labels=["op"]
    )
    for op, h in sorted(stats.get("op_latency", {}).items()):
        bounds = [*(str(b) for b in BUCKETS), "+Inf"]
        cumulative = list(itertools.accumulate(h["buckets"]))
        latency.add_metric([op], list(zip(bounds, cumulative, strict=True)), h["sum"])
    yield latency
    l3 = stats.get("l3")
    if l3:
        for name, help_, key in L3_COUNTERS:
            yield CounterMetricFamily(f"hicache_{name}", help_, value=l3.get(key, 0))
        yield GaugeMetricFamily(
            "hicache_l3_breaker_open", "1 while the third tier's breaker is open",
            value=float(l3.get("breaker") != "closed"),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "hicache_l3_queued_pages",
            "pages waiting to be written",
            value=l3.get("queued_pages", 0),
        )


class MetricsServer:
    """The /metrics endpoint over the latest published snapshot."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server

        self.latest: dict[str, Any] = {}  # replaced whole by publish (atomic for readers)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        self.port = self.server.server_port

    def publish(self, stats: dict[str, Any]) -> None:
        self.latest = stats

    def collect(self) -> Iterator[Any]:
        yield from families(self.latest)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
