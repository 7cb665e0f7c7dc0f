"""BlockClient tells full from down: what it retries (connection errors, 502/503/504, after Retry-After), what it
answers at once (500, 507), and the one byte budget and circuit it keeps for both ways into vLLM.

Scripted statuses come from a tiny real aiohttp server on loopback; "full" comes from a real gateway whose store is
filled to capacity.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from connector.http.client import BlockClient, ClientConfig, GatewayRejected, GatewayUnavailable, retry_after_s
from tests.conftest import key_for, random_bytes
from tests.gateway import Gateway

LOOKUP_OK = json.dumps({"prefix": 0, "blocks": []}).encode()


@dataclass
class Scripted:
    """A loopback HTTP server answering each request with the next (status, headers, body) of its script."""

    script: list[tuple[int, dict[str, str], bytes]]
    seen: list[tuple[float, str, str]] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen.append((time.monotonic(), request.method, request.path))
        status, headers, body = self.script.pop(0) if self.script else (200, {}, LOOKUP_OK)
        return web.Response(status=status, headers=headers, body=body)


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    server = Scripted(script=[])
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    runner: list[web.AppRunner] = []

    async def start() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", server.handle)
        r = web.AppRunner(app)
        await r.setup()
        site = web.TCPSite(r, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        server.url = f"http://127.0.0.1:{port}"
        runner.append(r)
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    assert ready.wait(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def client(url: str, **kw: float) -> BlockClient:
    cfg = {"retries": 3, "backoff_s": 0.001, "down_cooldown_s": 30.0, **kw}
    return BlockClient(ClientConfig(base_url=url, **cfg))  # type: ignore[arg-type]


def test_503_waits_for_retry_after(scripted: Scripted) -> None:
    scripted.script = [(503, {"Retry-After": "1"}, b"busy")]
    with client(scripted.url) as c:
        assert c.run(c.lookup([key_for(1)]), timeout_s=30) == (0, [])
        assert not c.gateway_down
        assert c.stats.retries == 1
    (first, *_), (second, *_) = scripted.seen
    assert second - first >= 0.95  # the backoff alone would have waited 1 ms: Retry-After was honoured


def test_retry_after_is_capped(scripted: Scripted) -> None:
    scripted.script = [(503, {"Retry-After": "3600"}, b"busy"), (504, {"Retry-After": "3600"}, b"slow")]
    with client(scripted.url, max_retry_after_s=0.01) as c:
        assert c.run(c.lookup([key_for(1)]), timeout_s=30) == (0, [])  # not an hour later
    assert len(scripted.seen) == 3


def test_502_503_504_are_retried_then_an_outage_that_opens_the_circuit(scripted: Scripted) -> None:
    scripted.script = [(502, {}, b""), (503, {}, b""), (504, {}, b""), (503, {}, b""), (200, {}, LOOKUP_OK)]
    with client(scripted.url, retries=3) as c:
        with pytest.raises(GatewayUnavailable):
            c.run(c.lookup([key_for(1)]), timeout_s=30)
        assert len(scripted.seen) == 4 and c.stats.retries == 3
        assert c.gateway_down
        with pytest.raises(GatewayUnavailable, match="marked down"):  # at once: no request reaches the server
            c.run(c.lookup([key_for(1)]), timeout_s=30)
    assert len(scripted.seen) == 4


def test_500_is_answered_at_once_and_is_no_outage(scripted: Scripted) -> None:
    scripted.script = [(500, {}, b"bug")]
    with client(scripted.url) as c:
        with pytest.raises(GatewayRejected) as err:
            c.run(c.put(key_for(1), b"x"), timeout_s=30)
        assert err.value.status == 500
        assert len(scripted.seen) == 1 and c.stats.retries == 0
        assert not c.gateway_down


def test_507_drops_the_store_counts_it_and_lookups_go_on(scripted: Scripted) -> None:
    scripted.script = [(507, {}, b'{"error":{"code":"insufficient_storage"}}')]
    with client(scripted.url) as c:
        assert c.run(c.put(key_for(1), b"x"), timeout_s=30) is False
        assert c.stats.full_stores == 1 and c.stats.puts == 0 and c.stats.retries == 0
        assert not c.gateway_down
        assert c.run(c.lookup([key_for(1)]), timeout_s=30) == (0, [])
    assert [m for _t, m, _p in scripted.seen] == ["PUT", "POST"]


def test_gateway_full_is_not_down(tmp_path: Path) -> None:
    """A real gateway filled to capacity answers 507: the client drops the store; lookups and reads go on."""
    block = 64 * 1024
    gw = Gateway(tmp_path / "data", env={"KVGATE_MAX_BYTES": str(4 * block)}).start()
    try:
        with client(gw.url) as c:
            kept = random_bytes(block, seed=1)
            assert c.run(c.put(key_for(1), kept), timeout_s=30) is True
            too_big = random_bytes(4 * block + 1, seed=2)
            assert c.run(c.put(key_for(2), too_big), timeout_s=30) is False
            assert c.stats.full_stores == 1 and c.stats.retries == 0
            assert not c.gateway_down
            prefix, slots = c.run(c.lookup([key_for(1), key_for(2)]), timeout_s=30)
            assert prefix == 1 and [s.present for s in slots] == [True, False]
            assert c.run(c.get(key_for(1)), timeout_s=30) == kept
        assert httpx.head(f"{gw.url}/v1/blocks/{key_for(2)}").status_code == 404
    finally:
        gw.stop()


def test_one_budget_for_reserve_and_hold(scripted: Scripted) -> None:
    """The connector's ``reserve`` and the tier's ``hold`` draw on the same bytes; a release from another thread
    lets a waiting ``hold`` through."""
    with BlockClient(ClientConfig(base_url=scripted.url, max_inflight_bytes=1000)) as c:
        assert c.reserve(800)
        entered = threading.Event()

        async def tier_transfer() -> int:
            async with c.hold(500, timeout_s=30):
                entered.set()
                return c.inflight_bytes

        fut = c.submit(tier_transfer())
        assert not entered.wait(0.2)  # 800 + 500 > 1000: it waits (a bounded wait: no timing asserted)
        assert not c.reserve(300)  # and the connector still sees the 800 held
        threading.Thread(target=c.release, args=(800,)).start()
        assert fut.result(timeout=30) == 500
        assert c.inflight_bytes == 0

        async def too_slow() -> None:
            async with c.hold(2000, timeout_s=30), c.hold(1, timeout_s=0.05):
                pass

        with pytest.raises(TimeoutError):  # a transfer larger than the budget runs alone; the next one waits
            c.run(too_slow(), timeout_s=30)
        assert c.inflight_bytes == 0


def test_retry_after_forms() -> None:
    assert retry_after_s("7") == 7.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None and retry_after_s("-1") is None
    now = datetime(2026, 1, 1, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert retry_after_s(later, now=now.timestamp()) == 30.0
    assert retry_after_s(format_datetime(now - timedelta(seconds=30), usegmt=True), now=now.timestamp()) == 0.0
