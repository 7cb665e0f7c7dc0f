"""Limits in process: uploads in flight (429), body caps (413), slow and stalled bodies (408), a locked index (503).
Header size and header time are uvicorn's protocol, so they stay in tests/security/test_limits.py.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import crc, key_for, random_bytes
from tests.inprocess.harness import InProcessGateway, running, settings_for


class HeldBody:
    """A request body that sends ``first`` bytes, then waits until released (or never): an upload in flight."""

    def __init__(self, first: bytes, rest: bytes = b"") -> None:
        self.first = first
        self.rest = rest
        self.reading = asyncio.Event()
        """Set once the server asked for more than the first chunk: the handler is reading the body."""
        self.release = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.first
        self.reading.set()
        await self.release.wait()
        if self.rest:
            yield self.rest


async def test_uploads_past_the_bound_get_429_at_once(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, max_uploads_in_flight=2)) as gw:
        c = gw.client
        bodies = {key_for(100 + i): random_bytes(2000, 100 + i) for i in range(2)}
        held = {k: HeldBody(v[:1000], v[1000:]) for k, v in bodies.items()}
        uploads = [
            asyncio.create_task(c.put(f"/v1/blocks/{k}", content=h, headers={"Content-Length": "2000"}))
            for k, h in held.items()
        ]
        async with asyncio.timeout(10):  # polling an observable: both handlers are reading their bodies
            await asyncio.gather(*(h.reading.wait() for h in held.values()))
        r = await c.put(f"/v1/blocks/{key_for(102)}", content=b"y" * 100)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_requests"
        assert (await c.head(f"/v1/blocks/{key_for(102)}")).status_code == 404
        assert (await c.get("/healthz")).status_code == 200  # reads are not bounded by the upload slots
        for h in held.values():
            h.release.set()
        assert [r.status_code for r in await asyncio.gather(*uploads)] == [201, 201]
        for k, v in bodies.items():
            assert (await c.get(f"/v1/blocks/{k}")).content == v
        # the slots came back
        assert (await c.put(f"/v1/blocks/{key_for(102)}", content=b"y" * 100)).status_code == 201


async def test_slot_comes_back_after_a_failed_upload(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, max_uploads_in_flight=1)) as gw:
        for i in range(3):  # each refused upload gives its slot back
            r = await gw.client.put(
                f"/v1/blocks/{key_for(i)}", content=b"a" * 10, headers={"X-KVGate-SHA256": "0" * 64}
            )
            assert r.status_code == 400
        assert (await gw.client.put(f"/v1/blocks/{key_for(9)}", content=b"a" * 10)).status_code == 201


async def test_json_body_caps(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, max_json_body_bytes=20_000)) as gw:
        big = {"keys": [key_for(i) for i in range(400)]}  # ~ 40 KB, over the 20 KB cap
        r = await gw.client.post("/v1/lookup", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the cap is counted as it streams
            yield b'{"keys": ['
            for i in range(400):
                yield f'"{key_for(i)}",'.encode()
            yield b'"x"]}'

        r = await gw.client.post("/v1/lookup", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert (await gw.client.post("/v1/lookup", json={"keys": [key_for(1)]})).status_code == 200
        # the cap is for JSON bodies: a block of the same size goes in
        block = random_bytes(30_000, 1)
        assert (await gw.client.put(f"/v1/blocks/{key_for(1)}", content=block)).status_code == 201


@pytest.mark.parametrize("first", [0, 500], ids=["silent", "fast-start"])
async def test_stalled_body_is_408_and_stores_nothing(tmp_path: Path, first: int) -> None:
    cfg = settings_for(tmp_path, fs=True, body_grace_s=0, body_min_rate_bytes_s=1_000_000, body_idle_timeout_s=0.2)
    async with running(cfg) as gw:
        key = key_for(200)
        body = HeldBody(b"a" * first)  # then nothing: the idle or the rate bound cuts it off
        r = await gw.client.put(f"/v1/blocks/{key}", content=body, headers={"Content-Length": "50000"})
        assert r.status_code == 408
        assert r.json()["error"]["code"] == "request_timeout"
        assert r.headers["connection"] == "close"
        assert (await gw.client.head(f"/v1/blocks/{key}")).status_code == 404
        assert [p for p in tmp_path.rglob("*") if p.name.startswith(".kvgate-tmp-")] == []
        assert (await gw.stats())["usage_bytes"] == 0
        data = random_bytes(5000, 1)  # and the next upload is served
        assert (await gw.client.put(f"/v1/blocks/{key}", content=data)).status_code == 201
        assert (await gw.client.get(f"/v1/blocks/{key}")).content == data


async def test_locked_index_is_503_then_recovers(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, sqlite_busy_timeout_s=0.2)) as gw:
        c = gw.client
        present = random_bytes(10_000, 1)
        assert (await c.put(f"/v1/blocks/{key_for(1)}", content=present)).status_code == 201
        holder = sqlite3.connect(tmp_path / "index.db", isolation_level=None, timeout=5)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            r = await c.put(f"/v1/blocks/{key_for(2)}", content=b"new" * 1000)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "index_unavailable"
            ready = await c.get("/readyz")
            assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
            assert (await c.get(f"/v1/blocks/{key_for(1)}")).content == present  # WAL: reads go on
            r = await c.put(f"/v1/blocks/{key_for(1)}", content=b"other" * 2000)
            assert r.status_code == 503
            got = await c.get(f"/v1/blocks/{key_for(1)}")  # never new bytes under the old ETag
            assert got.status_code == 404 or (got.content == present and got.headers["etag"] == f'"{crc(present)}"')
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        again = await c.put(f"/v1/blocks/{key_for(2)}", content=b"new" * 1000)
        assert again.status_code == 201  # the PUT answered 503 left nothing behind
        assert (await c.get(f"/v1/blocks/{key_for(2)}")).content == b"new" * 1000
        assert (await c.get("/readyz")).status_code == 200


async def test_metrics_count_requests(gw: InProcessGateway) -> None:
    assert (await gw.client.put(f"/v1/blocks/{key_for(1)}", content=b"m" * 100)).status_code == 201
    assert (await gw.client.get(f"/v1/blocks/{key_for(1)}")).status_code == 200
    assert (await gw.client.get(f"/v1/blocks/{key_for(2)}")).status_code == 404
    from tests.capacity.helpers import scrape

    samples = scrape((await gw.client.get("/metrics")).text)
    route = "/v1/blocks/{path}"
    assert samples[("kvgate_requests_total", (("method", "PUT"), ("route", route), ("status", "201")))] == 1
    assert samples[("kvgate_requests_total", (("method", "GET"), ("route", route), ("status", "404")))] == 1
    assert samples[("kvgate_hits_total", ())] == 1 and samples[("kvgate_misses_total", ())] == 1
    assert samples[("kvgate_usage_bytes", ())] == 100
