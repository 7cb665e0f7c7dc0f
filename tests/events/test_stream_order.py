"""Complete streams: a batch sent right after the SSE ``hello`` is not missed, and a child block's store comes after
its parent's when the parent's PUT was still in progress (one writer storing a prompt's blocks concurrently)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from starlette.requests import Request

from app.api.routes.events import events as events_route
from app.core.events_feed import EventFeed
from app.core.events_publisher import Publisher
from tests.conftest import key_for
from tests.events.helpers import events_gateway, hello, read_batches
from tests.events.log_harness import log_index, record, sqlite_url

MiB = 1024 * 1024


def test_a_batch_right_after_hello_is_not_missed(tmp_path: Path) -> None:
    """Without ``since``, the stream starts at the hello's ``next_seq``: a batch sent between the hello going out and
    the subscription (the response's next step) is read from the stored batches, not lost."""

    async def run() -> None:
        async with log_index(sqlite_url(tmp_path)) as index:
            feed = EventFeed(index=index, codec=None, poll_s=0.05)
            publisher = Publisher(index=index, published=feed.published)
            await publisher.resume()
            app = SimpleNamespace(state=SimpleNamespace(events=feed))
            request = Request({"type": "http", "method": "GET", "path": "/v1/events", "headers": [], "app": app})
            resp = await events_route(request=request, since=None, namespace=None, last_event_id=None)
            body: AsyncIterator[Any] = resp.body_iterator
            first = await anext(body)
            assert b"event: hello" in first and f'"next_seq":{publisher.next_seq}'.encode() in first
            await index.swap_block(record(key_for(1)))  # committed while the hello was on its way
            assert await publisher.round() == 1
            batch = await asyncio.wait_for(anext(body), 5)  # before phase 1's fix: never (heartbeats only)
            assert b"event: batch" in batch and key_for(1).encode() in batch
            await body.aclose()

    asyncio.run(run())


def test_child_store_waits_for_its_parents_put_in_progress(tmp_path: Path) -> None:
    """A writer PUTs a parent block and its children at once; the parent's body is still arriving when the children
    commit. Their events come after the parent's, in chain order; a store whose parent is not being written goes out
    at once."""
    gw = events_gateway(tmp_path / "data").start()
    parent, child, grandchild, loner = key_for(1), key_for(2), key_for(3), key_for(4)
    h = {k: k.rsplit("/", 1)[1].removesuffix(".bin") for k in (parent, child, grandchild, loner)}
    try:
        start = hello(gw.url)["next_seq"]

        async def run() -> None:
            first_sent, release = asyncio.Event(), asyncio.Event()

            async def slow_body() -> AsyncIterator[bytes]:
                # more than the loopback socket buffers hold: once it is written, the gateway is reading this body
                # (its PUT has begun); the rest waits
                yield b"p" * (24 * MiB)
                first_sent.set()
                await release.wait()
                yield b"p" * MiB

            async with httpx.AsyncClient(base_url=gw.url, timeout=120) as http:
                put_parent = asyncio.create_task(
                    http.put(
                        f"/v1/blocks/{parent}",
                        content=slow_body(),
                        headers={"Content-Length": str(25 * MiB), "X-KVGate-Block-Meta": "tokens=1,2"},
                    )
                )
                await first_sent.wait()
                meta = {"X-KVGate-Block-Meta": f"parent={h[parent]}; tokens=3,4"}
                assert (await http.put(f"/v1/blocks/{child}", content=b"c", headers=meta)).status_code == 201
                meta = {"X-KVGate-Block-Meta": f"parent={h[child]}; tokens=5,6"}
                assert (await http.put(f"/v1/blocks/{grandchild}", content=b"g", headers=meta)).status_code == 201
                meta = {"X-KVGate-Block-Meta": f"parent={hashlib.sha256(b'x').hexdigest()}; tokens=7"}
                assert (await http.put(f"/v1/blocks/{loner}", content=b"l", headers=meta)).status_code == 201
                release.set()
                assert (await put_parent).status_code == 201

        asyncio.run(run())
        batches = read_batches(gw.url, since=start, events=4)
        order = [e["key"] for b in batches for e in b["events"]]
        assert order == [loner, parent, child, grandchild]
        tokens = {e["key"]: e["token_ids"] for b in batches for e in b["events"]}
        assert tokens[grandchild] == [5, 6]
    finally:
        gw.stop()
