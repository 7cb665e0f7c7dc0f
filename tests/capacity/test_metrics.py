"""/metrics: parseable, per-app registry, and counters that move by exactly what the test drove."""

from __future__ import annotations

from pathlib import Path

import httpx

from app.config import Settings
from app.main import create_app
from tests.capacity.helpers import scrape
from tests.conftest import key_for
from tests.gateway import Gateway

ROUTE = "/v1/blocks/{path}"


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_move_by_exact_deltas(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        first = c.get("/metrics")
        assert first.status_code == 200 and first.headers["content-type"].startswith("text/plain")
        m0 = scrape(first.text)
        responses = []
        bodies = [b"a" * 1000, b"b" * 2000, b"c" * 3000]
        for i, b in enumerate(bodies):
            responses.append(c.put(f"/v1/blocks/{key_for(i)}", content=b))
        responses += [c.get(f"/v1/blocks/{key_for(0)}"), c.get(f"/v1/blocks/{key_for(1)}")]
        responses += [c.get(f"/v1/blocks/{key_for(77)}"), c.head(f"/v1/blocks/{key_for(78)}")]
        responses.append(c.head(f"/v1/blocks/{key_for(2)}"))
        responses.append(c.post("/v1/lookup", json={"keys": [key_for(0), key_for(9)]}))
        responses.append(c.get("/no/such/route"))
        m1 = scrape(c.get("/metrics").text)

    def delta(name: str, **labels: str) -> float:
        return value(m1, name, **labels) - value(m0, name, **labels)

    assert [r.status_code for r in responses] == [201, 201, 201, 200, 200, 404, 404, 200, 200, 404]
    assert delta("kvgate_requests_total", method="PUT", route=ROUTE, status="201") == 3
    assert delta("kvgate_requests_total", method="GET", route=ROUTE, status="200") == 2
    assert delta("kvgate_requests_total", method="GET", route=ROUTE, status="404") == 1
    assert delta("kvgate_requests_total", method="HEAD", route=ROUTE, status="404") == 1
    assert delta("kvgate_requests_total", method="HEAD", route=ROUTE, status="200") == 1
    assert delta("kvgate_requests_total", method="POST", route="/v1/lookup", status="200") == 1
    assert delta("kvgate_requests_total", method="GET", route="/metrics", status="200") == 1  # the first scrape
    assert delta("kvgate_requests_total", method="GET", route="<unmatched>", status="404") == 1
    routes = {v for _, labels in m1 for k, v in labels if k == "route"}
    assert {r for r in routes if r.startswith("/v1/blocks/")} == {ROUTE}  # templates, never raw URLs
    assert delta("kvgate_request_duration_seconds_count", method="PUT", route=ROUTE) == 3
    assert delta("kvgate_hits_total") == 3  # 2 GET + 1 HEAD
    assert delta("kvgate_misses_total") == 2
    assert delta("kvgate_evictions_total") == 0
    lookup_body = len(httpx.Request("POST", "http://x", json={"keys": [key_for(0), key_for(9)]}).content)
    assert delta("kvgate_bytes_in_total") == sum(len(b) for b in bodies) + lookup_body
    assert delta("kvgate_bytes_out_total") == len(first.content) + sum(len(r.content) for r in responses)
    assert value(m1, "kvgate_usage_bytes") == 6000
    assert value(m1, "kvgate_usage_blocks") == 3


def test_process_and_gc_series_describe_the_server_process(gateway: Gateway) -> None:
    """The standard process_* and python_gc_* series are there, and they are the gateway's process, not the test's."""
    assert gateway.proc is not None
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        m0 = scrape(c.get("/metrics").text)
        keys = [key_for(i) for i in range(1000)]
        for _ in range(20):  # some CPU for process_cpu_seconds_total to count
            assert c.post("/v1/lookup", json={"keys": keys}).status_code == 200
        m1 = scrape(c.get("/metrics").text)
    status = Path(f"/proc/{gateway.proc.pid}/status").read_text()
    rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
    assert 0.5 * rss < value(m1, "process_resident_memory_bytes") < 2 * rss
    fds = len(list(Path(f"/proc/{gateway.proc.pid}/fd").iterdir()))
    assert abs(value(m1, "process_open_fds") - fds) <= 2  # the scrape's own connection may come and go
    assert value(m1, "process_cpu_seconds_total") > value(m0, "process_cpu_seconds_total")
    # start-up alone runs hundreds of young collections; the oldest generation's series is there too
    assert value(m1, "python_gc_collections_total", generation="0") > 0
    assert ("python_gc_collections_total", (("generation", "2"),)) in m1
    assert any(name == "python_info" for name, _ in m1)


def test_each_app_has_its_own_registry(tmp_path: Path) -> None:
    apps = [create_app(Settings(data_dir=tmp_path / f"d{i}")) for i in range(3)]  # no duplicate-series error
    registries = {id(a.state.metrics_registry) for a in apps}
    assert len(registries) == 3


def test_metrics_can_be_disabled(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data", env={"KVGATE_METRICS_ENABLED": "false"}).start()
    try:
        assert httpx.get(f"{gw.url}/metrics").status_code == 404
    finally:
        gw.stop()
