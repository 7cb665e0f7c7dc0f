"""RequestRecorder (plain numbers, turned into samples at scrape time) exposes what prometheus_client's own Counter
and Histogram expose for the same requests: names, labels, bucket bounds and counts (a value equal to a bound is in
its bucket), sums, ``_created`` series."""

from __future__ import annotations

import random
import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from app.api.middleware.metrics import LATENCY_BUCKETS, RequestRecorder


def _native(registry: CollectorRegistry) -> tuple[Counter, Histogram, Counter, Counter]:
    return (
        Counter("kvgate_requests", "HTTP requests", ["method", "route", "status"], registry=registry),
        Histogram(
            "kvgate_request_duration_seconds",
            "HTTP request latency, until the last body byte is sent",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ),
        Counter("kvgate_bytes_in", "request body bytes received", registry=registry),
        Counter("kvgate_bytes_out", "response body bytes sent", registry=registry),
    )


def _without_created_values(text: str) -> list[str]:
    lines = [re.sub(r"^(\w+_created\{?.*?\}?) .*$", r"\1", line) for line in text.splitlines()]
    return sorted(lines)


def test_the_recorder_exposes_what_prometheus_client_does() -> None:
    native_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    requests, latency, bytes_in, bytes_out = _native(native_registry)
    recorder = RequestRecorder()
    ours_registry.register(recorder)
    rng = random.Random(7)
    routes = ["/v1/blocks/{path}", "/v1/lookup", "<unmatched>"]
    values = [0.0, *LATENCY_BUCKETS, 10.5, 1e-9]  # every bound exactly, and either side
    for i in range(500):
        method, route = rng.choice(["GET", "HEAD", "PUT"]), rng.choice(routes)
        status = rng.choice([200, 201, 404, 503])
        seconds = values[i] if i < len(values) else rng.uniform(0, 12)
        received, sent = rng.choice([0, 100]), rng.choice([0, 65536])
        recorder.record(method, route, status, seconds, received, sent)
        requests.labels(method, route, str(status)).inc()
        latency.labels(method, route).observe(seconds)
        if received:
            bytes_in.inc(received)
        if sent:
            bytes_out.inc(sent)
    ours = generate_latest(ours_registry).decode()
    native = generate_latest(native_registry).decode()
    assert _without_created_values(ours) == _without_created_values(native)
    assert 'kvgate_request_duration_seconds_bucket{le="0.0005"' in ours
    assert "kvgate_request_duration_seconds_created{" in ours and "kvgate_requests_created{" in ours
