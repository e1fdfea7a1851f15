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

from hicache.observe import DISK_FIGURES, FIGURES, L3_FIGURES, Figure

log = logging.getLogger("hicache.daemon.metrics")
LIVE_S = 10.0  # /healthz fails when the control loop has not gone round for this long

# the help of each family with a ``tier`` label (its figures' own say one tier each)
BY_TIER = {
    "capacity_tokens": "tokens a tier holds",
    "cached_tokens": "tokens cached in a tier",
    "protected_tokens": "cached tokens under a lock now, by tier",
    "evictable_tokens": "cached tokens with no lock now, by tier",
    "evicted_tokens": "tokens evicted, by tier",
    "hit_tokens": "prompt tokens found cached, by tier",
    "huge_page_bytes": "bytes of a pool on huge pages, by tier",
}


def _exported(figures: tuple[Figure, ...], stats: dict[str, Any]) -> Iterator[Any]:
    """One family per Prometheus name of ``figures`` (hicache/observe/figures.py), in the
    table's order: a counter or a gauge, with a ``tier`` label where the table gives one."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    families: dict[str, Any] = {}
    for f in figures:
        if not f.metric or not (f.always or f.name in stats):
            continue
        value = stats.get(f.name, 0)
        family = families.get(f.metric)
        if family is None:
            kind = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
            name = f"hicache_{f.metric}"
            if f.tier:
                family = kind(name, BY_TIER[f.metric], labels=["tier"])
            else:
                family = kind(name, f.help, value=value)
            families[f.metric] = family
        if f.tier:
            family.add_metric([f.tier], value)
    yield from families.values()


def families(stats: dict[str, Any]) -> Iterator[Any]:
    """The metric families of one stats snapshot (``{}``: nothing yet)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    if not stats:
        return
    yield from _exported(FIGURES, stats)
    queried = stats.get("hit_device_tokens", 0) + stats.get("hit_host_tokens", 0)
    queried += stats.get("miss_tokens", 0)
    yield CounterMetricFamily("hicache_query_tokens", "prompt tokens matched", value=queried)
    evicted_bytes = CounterMetricFamily(
        "hicache_evicted_bytes", "KV bytes evicted, by tier", labels=["tier"]
    )
    for tier in ("device", "host"):
        tokens = stats.get(f"evicted_{tier}_tokens", 0)
        evicted_bytes.add_metric([tier], tokens * stats.get("token_bytes", 0))
    yield evicted_bytes
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
        yield from _exported(L3_FIGURES, l3)
        yield from _exported(DISK_FIGURES, l3)  # (a disk's: only when it reports them)
        yield GaugeMetricFamily(
            "hicache_l3_breaker_open", "1 while the third tier's breaker is open",
            value=float(l3.get("breaker") != "closed"),
        )  # fmt: skip


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
