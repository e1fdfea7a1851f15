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
import logging
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("hicache.daemon.metrics")
LIVE_S = 10.0  # /healthz fails when the control loop has not gone round for this long

# (name, help, stats key) of plain counters
COUNTERS = [
    ("backup_tokens", "tokens copied from the device to the host tier", "backup_tokens"),
    ("backup_bytes", "bytes copied from the device to the host tier", "backup_bytes"),
    ("load_tokens", "tokens loaded from the host to the device tier", "load_tokens"),
    ("load_bytes", "bytes loaded from the host to the device tier", "load_bytes"),
    ("backup_failed_tokens", "tokens whose backup failed or found no room", "backup_failed_tokens"),
    (
        "engine_queried_tokens",
        "tokens engines asked about beyond their own prefix cache's hit, as they count them",
        "engine_queried_tokens",
    ),
    (
        "engine_hit_tokens",
        "of the engines' queried tokens, those hicache had, as the engines count them",
        "engine_hit_tokens",
    ),
    (
        "engine_loaded_tokens",
        "tokens engines copied from the daemon's pool into their own device tier",
        "engine_loaded_tokens",
    ),
    ("transfer_errors", "copies between the tiers that failed", "transfer_errors"),
    ("replies_dropped", "replies dropped because a peer did not read", "replies_dropped"),
    (
        "connections_closed",
        "tcp connections closed: they sent more than may be held unread",
        "connections_closed",
    ),
    ("leases_expired", "engine sessions whose lease ran out", "leases_expired"),
    (
        "match_parts",
        "batched matches answered in part because other requests waited",
        "match_parts",
    ),
    (
        "views_refused",
        "integrity checks and tree views refused: past their share of the control loop",
        "views_refused",
    ),
    ("gc_collections", "runs of Python's cycle collector in the daemon", "gc_collections"),
    (
        "gc_pause_seconds",
        "seconds in Python's cycle collector (the control loop waits meanwhile)",
        "gc_pause_seconds",
    ),
    ("event_batches_published", "KV event batches published", "event_batches_published"),
    (
        "event_batches_dropped",
        "KV event batches dropped: publisher behind",
        "event_batches_dropped",
    ),
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
    for name, help_ in (("protected", "under a lock"), ("evictable", "with no lock")):
        family = GaugeMetricFamily(
            f"hicache_{name}_tokens", f"cached tokens {help_} now, by tier", labels=["tier"]
        )
        for tier in ("device", "host"):  # (the tier of the cache's device pool: tier_names.py)
            if f"{tier}_{name}_tokens" in stats:
                family.add_metric([tier], stats[f"{tier}_{name}_tokens"])
        yield family
    evicted = CounterMetricFamily(
        "hicache_evicted_tokens", "tokens evicted, by tier", labels=["tier"]
    )
    evicted.add_metric(["device"], stats.get("evicted_device_tokens", 0))
    evicted.add_metric(["host"], stats.get("evicted_host_tokens", 0))
    yield evicted
    evicted_bytes = CounterMetricFamily(
        "hicache_evicted_bytes", "KV bytes evicted, by tier", labels=["tier"]
    )
    for tier in ("device", "host"):
        tokens = stats.get(f"evicted_{tier}_tokens", 0)
        evicted_bytes.add_metric([tier], tokens * stats.get("token_bytes", 0))
    yield evicted_bytes
    for name, help_, key in COUNTERS:
        yield CounterMetricFamily(f"hicache_{name}", help_, value=stats.get(key, 0))
    yield GaugeMetricFamily("hicache_sessions", "engine sessions", value=stats.get("sessions", 0))
    yield GaugeMetricFamily(
        "hicache_gc_pause_seconds_max",
        "the longest run of Python's cycle collector since start",
        value=stats.get("gc_pause_seconds_max", 0),
    )
    yield GaugeMetricFamily(
        "hicache_gc_frozen_objects",
        "objects start-up made, kept out of the cycle collector's sight",
        value=stats.get("gc_frozen_objects", 0),
    )
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
        latency.add_metric([op], _buckets(h), h["sum"])
    yield latency
    for key, name, help_ in (
        ("transfer_seconds", "hicache_transfer_duration_seconds", "submit to ack of a copy"),
        ("transfer_bytes", "hicache_transfer_size_bytes", "bytes of a copy"),
    ):
        copies = HistogramMetricFamily(name, f"{help_}, by direction", labels=["direction"])
        for direction, h in sorted(stats.get(key, {}).items()):
            copies.add_metric([direction], _buckets(h), h["sum"])
        yield copies
    points = stats.get("capacity_points")
    if points:
        est = GaugeMetricFamily(
            "hicache_estimated_hit_ratio",
            "hit ratio the tiers would have at factor times today's size (SHARDS estimate)",
            labels=["tier", "factor"],
        )
        for p in points:
            est.add_metric(["device", f"{p['factor']:g}"], p["device_hit"])
            est.add_metric(["host", f"{p['factor']:g}"], p["total_hit"] - p["device_hit"])
            est.add_metric(["total", f"{p['factor']:g}"], p["total_hit"])
        yield est
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


def _buckets(h: dict[str, Any]) -> list[tuple[str, int]]:
    """A Histogram.as_dict as prometheus-client's cumulative (le, count) pairs."""
    bounds = [*(f"{b:g}" for b in h["bounds"]), "+Inf"]
    return list(zip(bounds, itertools.accumulate(h["buckets"]), strict=True))


class MetricsServer:
    """The HTTP endpoint of ``--metrics-port``: ``/metrics`` over the latest published snapshot,
    ``/healthz`` (liveness: the control loop went round within LIVE_S) and ``/readyz``
    (readiness: live, and not draining). Its thread reads only what the loop published."""

    def __init__(self, host: str, port: int):
        self.latest: dict[str, Any] = {}  # replaced whole by publish (atomic for readers)
        self.beat_at = time.monotonic()  # the control loop's last round (set by beat())
        self.draining = False
        self._registry = None
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:  # health still works; /metrics says what is missing
            log.warning(
                "prometheus-client is not installed: /metrics answers 501 (pip install "
                "hicache[metrics]); /healthz and /readyz work"
            )
        else:
            self._registry = CollectorRegistry(auto_describe=False)
            self._registry.register(self)
        self.server = _Server((host, port), _handler(self))
        self.server.daemon_threads = True
        self.port = self.server.server_port
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="hicache-metrics", daemon=True
        )
        self.thread.start()

    def publish(self, stats: dict[str, Any]) -> None:
        self.latest = stats

    def beat(self, draining: bool = False) -> None:
        """The control loop is alive (called every housekeeping pass)."""
        self.beat_at, self.draining = time.monotonic(), draining

    def health(self, path: str) -> tuple[int, str]:
        age = time.monotonic() - self.beat_at
        if age > LIVE_S:
            return 503, f"not live: the control loop last went round {age:.1f} s ago\n"
        if path == "/readyz" and self.draining:
            return 503, "not ready: draining (shutting down)\n"
        return 200, "ok\n"

    def collect(self) -> Iterator[Any]:
        yield from families(self.latest)

    def render(self) -> tuple[int, bytes, str]:
        if self._registry is None:
            return (
                501,
                b"pip install prometheus-client (hicache[metrics]) for /metrics\n",
                "text/plain",
            )
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

        return 200, generate_latest(self._registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A scraper that hung up mid-reply: one log line, not a traceback on stderr."""
        log.debug("metrics client %s: %s", client_address, sys.exc_info()[1])


def _handler(owner: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # seconds a client may take to send its request (slow clients go)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(head=True)

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self._answer(head=False)

        def _answer(self, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                code, body, kind = owner.render()
            elif path in ("/healthz", "/livez", "/readyz"):
                code, text = owner.health(path)
                body, kind = text.encode(), "text/plain; charset=utf-8"
            else:
                code, body, kind = 404, b"/metrics, /healthz, /readyz\n", "text/plain"
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # scrapes are not events worth a line
            pass

    return Handler
