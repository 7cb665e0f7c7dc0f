"""Prometheus metrics: one registry per app instance and a pure-ASGI middleware (``GET /metrics`` is a route).

Requests are labelled by the route's path template (``/v1/blocks/{path:path}``), never the raw URL, so the label
cardinality is bounded by the number of routes. Hits, misses, evictions and usage are read at scrape time from the
service and the capacity objects (no double bookkeeping on the request path).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UNMATCHED = "<unmatched>"


class HttpMetrics:
    """The request-side collectors, registered on the app's own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("kvgate_requests", "HTTP requests", ["method", "route", "status"], registry=registry)
        self.latency = Histogram(
            "kvgate_request_duration_seconds",
            "HTTP request latency, until the last body byte is sent",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.bytes_in = Counter("kvgate_bytes_in", "request body bytes received", registry=registry)
        self.bytes_out = Counter("kvgate_bytes_out", "response body bytes sent", registry=registry)


class ServiceCollector(Collector):
    """Hits, misses, evictions and usage, read from the live objects at scrape time."""

    def __init__(self, app_state: Any) -> None:
        self._state = app_state

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        core = getattr(self._state, "core", None)  # none before the lifespan has built it
        if core is None:
            return
        svc, cap = core.service, core.capacity
        yield CounterMetricFamily("kvgate_hits", "block reads (GET/HEAD) that found the block", svc.counters.hits)
        yield CounterMetricFamily("kvgate_misses", "block reads (GET/HEAD) that missed", svc.counters.misses)
        yield CounterMetricFamily("kvgate_evictions", "blocks evicted to stay within capacity", cap.evictions)
        yield CounterMetricFamily("kvgate_evicted_bytes", "bytes evicted to stay within capacity", cap.evicted_bytes)
        yield GaugeMetricFamily("kvgate_usage_bytes", "bytes of stored blocks", cap.usage.bytes)
        yield GaugeMetricFamily("kvgate_usage_blocks", "stored blocks", cap.usage.blocks)
        if cap.max_bytes is not None:
            yield GaugeMetricFamily("kvgate_max_bytes", "capacity bound", cap.max_bytes)


class MetricsMiddleware:
    """Counts requests, bytes and latency per route template; pure ASGI, so streaming is untouched."""

    def __init__(self, app: ASGIApp, *, metrics: HttpMetrics) -> None:
        self.app = app
        self.m = metrics
        # the labelled children, looked up once each (``labels()`` takes a lock and builds a key every call); as
        # bounded as the labels: methods x route templates x statuses
        self._counted: dict[tuple[str, str, int], Any] = {}
        self._timed: dict[tuple[str, str], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        is_head = scope.get("method") == "HEAD"  # the server drops a HEAD's body: it never goes out
        status = 500
        sent = 0
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        async def counting_send(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not is_head:
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path_format", None) or getattr(route, "path", None) or UNMATCHED
            method = scope.get("method", "")
            key = (method, template, status)
            counted = self._counted.get(key)
            if counted is None:
                counted = self._counted[key] = self.m.requests.labels(method, template, str(status))
            counted.inc()
            timed = self._timed.get((method, template))
            if timed is None:
                timed = self._timed[(method, template)] = self.m.latency.labels(method, template)
            timed.observe(time.perf_counter() - began)
            if received:
                self.m.bytes_in.inc(received)
            if sent:
                self.m.bytes_out.inc(sent)


def install(app: Any) -> None:
    """Give ``app`` its own registry (``app.state.metrics_registry``, served by :mod:`app.api.routes.metrics`) and
    the middleware."""
    registry = CollectorRegistry(auto_describe=True)
    http = HttpMetrics(registry)
    registry.register(ServiceCollector(app.state))
    # the standard process_* (CPU, memory, fds), python_gc_* and python_info series every Python exporter has
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    app.state.metrics_registry = registry
    app.add_middleware(MetricsMiddleware, metrics=http)
