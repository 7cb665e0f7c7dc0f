"""Prometheus metrics: one registry per app instance and a pure-ASGI middleware (``GET /metrics`` is a route).

Requests are labelled by the route's path template (``/v1/blocks/{path:path}``), never the raw URL, so the label
cardinality is bounded by the number of routes. Hits, misses, evictions and usage are read at scrape time from the
service and the capacity objects (no double bookkeeping on the request path).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UNMATCHED = "<unmatched>"


class Series:
    """One (method, route, status)'s request count and its (method, route)'s latency histogram, in a recorder."""

    __slots__ = ("_counted", "_recorder", "_timed")

    def __init__(self, recorder: RequestRecorder, counted: list[float], timed: list[float]) -> None:
        self._recorder = recorder
        self._counted = counted
        self._timed = timed

    def add(self, seconds: float, received: int, sent: int) -> None:
        self._counted[0] += 1
        timed = self._timed
        timed[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1  # le: a value equal to a bound is in its bucket
        timed[-2] += seconds
        if received:
            self._recorder.bytes_in += received
        if sent:
            self._recorder.bytes_out += sent


class RequestRecorder(Collector):
    """The request-side series (requests, latency, bytes), kept as plain numbers on the event loop and turned into
    Prometheus samples at scrape time. The same series as ``prometheus_client``'s Counter and Histogram give (names,
    labels, buckets, ``_created``), for a fraction of the CPU per request: no lock, no label lookup, no child
    objects, which were a large share of a HEAD the lane answers (figures: docs/benchmarks.md).
    The one place a request is recorded: the middleware's and the HEAD lane's (which answers without the
    middleware). Written from the event loop only; a scrape reads snapshots, from any thread."""

    def __init__(self) -> None:
        self._requests: dict[tuple[str, str, int], list[float]] = {}
        """(method, route, status) -> [count, created]"""
        self._series: dict[tuple[str, str, int], Series] = {}
        """(method, route, status) -> its Series, over its lists in ``_requests`` and ``_latency``"""
        self._latency: dict[tuple[str, str], list[float]] = {}
        """(method, route) -> [count in each bucket (not cumulative; +Inf last), sum, created]"""
        self.bytes_in = 0
        self.bytes_out = 0
        self._created = time.time()

    def record(self, method: str, template: str, status: int, seconds: float, received: int, sent: int) -> None:
        self.series(method, template, status).add(seconds, received, sent)

    def series(self, method: str, template: str, status: int) -> Series:
        """The series a request of these labels is counted in (made once, then kept): the lanes, which answer the
        same labels again and again, keep it too and :meth:`Series.add` to it (no label tuple, no look-up)."""
        found = self._series.get((method, template, status))
        if found is not None:
            return found
        counted = self._requests[(method, template, status)] = [0, time.time()]
        timed = self._latency.get((method, template))
        if timed is None:
            timed = self._latency[(method, template)] = [0] * (len(LATENCY_BUCKETS) + 1) + [0.0, time.time()]
        found = self._series[(method, template, status)] = Series(self, counted, timed)
        return found

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("kvgate_requests", "HTTP requests", labels=["method", "route", "status"])
        for (method, route, status), (count, created) in list(self._requests.items()):
            requests.add_metric([method, route, str(status)], count, created=created)
        yield requests
        name = "kvgate_request_duration_seconds"
        latency = HistogramMetricFamily(
            name, "HTTP request latency, until the last body byte is sent", labels=["method", "route"]
        )
        for (method, route), timed in list(self._latency.items()):
            counts, total, created = timed[:-2], timed[-2], timed[-1]
            buckets = list(zip(_BOUNDS, itertools.accumulate(counts), strict=True))
            latency.add_metric([method, route], buckets, total)
            latency.samples.append(Sample(f"{name}_created", {"method": method, "route": route}, created))
        yield latency
        yield CounterMetricFamily(
            "kvgate_bytes_in", "request body bytes received", value=self.bytes_in, created=self._created
        )
        yield CounterMetricFamily(
            "kvgate_bytes_out", "response body bytes sent", value=self.bytes_out, created=self._created
        )


_BOUNDS = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]


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
        scrub = core.scrub
        yield CounterMetricFamily(
            "kvgate_scrub_blocks", "blocks the scrub read back and found intact", scrub.blocks_checked
        )
        yield CounterMetricFamily("kvgate_scrub_bytes", "bytes the scrub read back", scrub.bytes_checked)
        yield CounterMetricFamily(
            "kvgate_scrub_corrupt", "blocks the scrub found corrupt (quarantined, rows removed)", scrub.corrupt_found
        )
        yield CounterMetricFamily("kvgate_scrub_passes", "whole scrub passes ended in this process", scrub.passes)
        yield GaugeMetricFamily(
            "kvgate_scrub_pass_done", "blocks checked so far in the current or last pass", scrub.pass_done
        )
        yield GaugeMetricFamily("kvgate_scrub_pass_blocks", "blocks in the current or last pass", scrub.pass_total)
        if scrub.last_pass_end is not None:
            yield GaugeMetricFamily(
                "kvgate_scrub_last_pass_end_seconds",
                "when this process's last scrub pass ended (Unix time)",
                scrub.last_pass_end,
            )


def route_template(route: Any) -> str:
    """A matched route's label: its path template (``/v1/blocks/{path}``); UNMATCHED for no route."""
    return getattr(route, "path_format", None) or getattr(route, "path", None) or UNMATCHED


class MetricsMiddleware:
    """Counts requests, bytes and latency per route template; pure ASGI, so streaming is untouched."""

    def __init__(self, app: ASGIApp, *, recorder: RequestRecorder) -> None:
        self.app = app
        self.recorder = recorder

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
            self.recorder.record(
                scope.get("method", ""),
                route_template(scope.get("route")),
                status,
                time.perf_counter() - began,
                received,
                sent,
            )


def install(app: Any) -> None:
    """Give ``app`` its own registry (``app.state.metrics_registry``, served by :mod:`app.api.routes.metrics`) and
    the middleware, whose recorder (``app.state.request_recorder``) the HEAD lane shares."""
    registry = CollectorRegistry(auto_describe=True)
    recorder = RequestRecorder()
    registry.register(recorder)
    registry.register(ServiceCollector(app.state))
    # the standard process_* (CPU, memory, fds), python_gc_* and python_info series every Python exporter has
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    app.state.metrics_registry = registry
    app.state.request_recorder = recorder
    app.add_middleware(MetricsMiddleware, recorder=recorder)
