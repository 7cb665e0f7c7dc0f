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
from app.events.feed import EventFeed
from app.events.publisher import Publisher
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


async def _while_the_parent_arrives(url: str, parent: str, puts: list[tuple[str, bytes, str]]) -> None:
    """PUT ``parent`` (25 MiB of ``p``) with a body that stalls once the gateway is reading it; meanwhile, the
    ``puts`` (key, body, meta), each acknowledged; then the rest of the parent's body."""
    first_sent, release = asyncio.Event(), asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        # more than the loopback socket buffers hold: once it is written, the gateway is reading this body (its PUT
        # has begun); the rest waits
        yield b"p" * (24 * MiB)
        first_sent.set()
        await release.wait()
        yield b"p" * MiB

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        put_parent = asyncio.create_task(
            http.put(
                f"/v1/blocks/{parent}",
                content=slow_body(),
                headers={"Content-Length": str(25 * MiB), "X-KVGate-Block-Meta": "tokens=1,2"},
            )
        )
        await first_sent.wait()
        for key, body, meta in puts:
            resp = await http.put(f"/v1/blocks/{key}", content=body, headers={"X-KVGate-Block-Meta": meta})
            assert resp.status_code == 201, resp.text
        release.set()
        assert (await put_parent).status_code in (200, 201)


def test_child_store_waits_for_its_parents_put_in_progress(tmp_path: Path) -> None:
    """A writer PUTs a parent block and its children at once; the parent's body is still arriving when the children
    commit. Their events come after the parent's, in chain order; a store whose parent is not being written goes out
    at once."""
    gw = events_gateway(tmp_path / "data").start()
    parent, child, grandchild, loner = key_for(1), key_for(2), key_for(3), key_for(4)
    h = {k: k.rsplit("/", 1)[1].removesuffix(".bin") for k in (parent, child, grandchild, loner)}
    try:
        start = hello(gw.url)["next_seq"]
        puts = [
            (child, b"c", f"parent={h[parent]}; tokens=3,4"),
            (grandchild, b"g", f"parent={h[child]}; tokens=5,6"),
            (loner, b"l", f"parent={hashlib.sha256(b'x').hexdigest()}; tokens=7"),
        ]
        asyncio.run(_while_the_parent_arrives(gw.url, parent, puts))
        batches = read_batches(gw.url, since=start, events=4)
        order = [e["key"] for b in batches for e in b["events"]]
        assert order == [loner, parent, child, grandchild]
        tokens = {e["key"]: e["token_ids"] for b in batches for e in b["events"]}
        assert tokens[grandchild] == [5, 6]
    finally:
        gw.stop()


def test_a_parent_put_of_the_bytes_it_holds_lets_its_child_go(tmp_path: Path) -> None:
    """The parent is held already, and a writer stores it again with the same bytes (the lookup said a block before
    it was missing) while its child commits. The PUT writes nothing and makes no event, but the child's event, which
    waited for that PUT, goes out when it ends (its release row), not ``events_hold_s`` (60 s) later: a router would
    see the chain broken at that child meanwhile."""
    gw = events_gateway(tmp_path / "data").start()
    parent, child = key_for(1), key_for(2)
    h = parent.rsplit("/", 1)[1].removesuffix(".bin")
    try:
        first = httpx.put(
            f"{gw.url}/v1/blocks/{parent}", content=b"p" * (25 * MiB), headers={"X-KVGate-Block-Meta": "tokens=1,2"}
        )
        assert first.status_code == 201
        start = hello(gw.url)["next_seq"]
        asyncio.run(_while_the_parent_arrives(gw.url, parent, [(child, b"c", f"parent={h}; tokens=3,4")]))
        batches = read_batches(gw.url, since=start, events=1)  # a heartbeat instead fails it
        assert [(e["type"], e["key"]) for b in batches for e in b["events"]] == [("BlockStored", child)]
    finally:
        gw.stop()
