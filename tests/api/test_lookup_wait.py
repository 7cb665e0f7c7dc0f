"""POST /v1/lookup with ``wait_ms``: a bounded wait for a prefix, woken by the gateway's own commits.

A real gateway process; the blocks are PUT over HTTP while a lookup waits for them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from app.api.routes.lookup import MAX_LOOKUP_WAIT_MS
from tests.conftest import key_for
from tests.gateway import Gateway

LONG_MS = 8_000
"""A wait that a lookup answered early never reaches (the assertions only say "before it", never how fast)."""


async def test_a_present_prefix_is_answered_at_once(client: httpx.AsyncClient) -> None:
    keys = [key_for(i) for i in range(3)]
    for k in keys:
        assert (await client.put(f"/v1/blocks/{k}", content=b"x" * 64)).status_code == 201
    start = time.monotonic()
    r = await client.post("/v1/lookup", json={"keys": keys, "wait_ms": LONG_MS})
    assert r.status_code == 200, r.text
    assert r.json()["prefix"] == 3
    assert time.monotonic() - start < LONG_MS / 1000


async def test_a_block_stored_during_the_wait_ends_it(client: httpx.AsyncClient) -> None:
    keys = [key_for(10 + i) for i in range(3)]
    assert (await client.put(f"/v1/blocks/{keys[0]}", content=b"a" * 64)).status_code == 201
    start = time.monotonic()
    waiting = asyncio.ensure_future(client.post("/v1/lookup", json={"keys": keys, "wait_ms": LONG_MS}))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # two of three are absent: it waits
    for k in keys[1:]:
        assert (await client.put(f"/v1/blocks/{k}", content=b"b" * 64)).status_code == 201
    r = await waiting
    assert r.status_code == 200, r.text
    assert r.json()["prefix"] == 3
    assert [s["present"] for s in r.json()["blocks"]] == [True, True, True]
    assert time.monotonic() - start < LONG_MS / 1000


async def test_min_prefix_ends_the_wait_before_every_key_is_present(client: httpx.AsyncClient) -> None:
    keys = [key_for(20 + i) for i in range(3)]
    waiting = asyncio.ensure_future(client.post("/v1/lookup", json={"keys": keys, "wait_ms": LONG_MS, "min_prefix": 2}))
    await asyncio.sleep(0.2)
    for k in keys[:2]:
        assert (await client.put(f"/v1/blocks/{k}", content=b"c" * 64)).status_code == 201
    r = await asyncio.wait_for(waiting, timeout=LONG_MS / 2000)
    assert r.json()["prefix"] == 2


async def test_past_the_deadline_it_answers_what_is_present(client: httpx.AsyncClient) -> None:
    keys = [key_for(30 + i) for i in range(3)]
    assert (await client.put(f"/v1/blocks/{keys[0]}", content=b"d" * 64)).status_code == 201
    start = time.monotonic()
    r = await client.post("/v1/lookup", json={"keys": keys, "wait_ms": 400})
    assert time.monotonic() - start >= 0.4
    assert r.status_code == 200, r.text
    assert r.json()["prefix"] == 1
    assert [s["present"] for s in r.json()["blocks"]] == [True, False, False]


async def test_a_wait_beyond_the_cap_is_cut_and_a_negative_one_is_422(client: httpx.AsyncClient) -> None:
    keys = [key_for(40)]
    assert (await client.put(f"/v1/blocks/{keys[0]}", content=b"e" * 64)).status_code == 201
    r = await client.post("/v1/lookup", json={"keys": keys, "wait_ms": MAX_LOOKUP_WAIT_MS * 1000})
    assert r.status_code == 200 and r.json()["prefix"] == 1
    bad = await client.post("/v1/lookup", json={"keys": keys, "wait_ms": -1})
    assert bad.status_code == 422, bad.text
    bad = await client.post("/v1/lookup", json={"keys": keys, "min_prefix": -1})
    assert bad.status_code == 422, bad.text
    for field in ("wait_ms", "min_prefix"):  # integers, not a JSON boolean read as one (schemathesis found it)
        bad = await client.post("/v1/lookup", json={"keys": keys, field: False})
        assert bad.status_code == 422, bad.text


async def test_a_plain_lookup_does_not_wait(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/lookup", json={"keys": [key_for(50)]})
    assert r.status_code == 200 and r.json()["prefix"] == 0


async def test_blocks_stored_through_another_worker_end_the_wait(tmp_path: Path) -> None:
    """``--workers 2``: a PUT on one worker wakes no one on the other; its re-check sees the block."""
    gw = Gateway(tmp_path / "data", workers=2).start()
    try:
        keys = [key_for(60 + i) for i in range(2)]
        clients = [httpx.AsyncClient(base_url=gw.url, timeout=30.0) for _ in range(6)]
        try:
            start = time.monotonic()
            waiting = [
                asyncio.ensure_future(c.post("/v1/lookup", json={"keys": keys, "wait_ms": LONG_MS})) for c in clients
            ]
            await asyncio.sleep(0.3)
            assert not any(w.done() for w in waiting)
            async with httpx.AsyncClient(base_url=gw.url, timeout=30.0) as writer:
                for k in keys:
                    assert (await writer.put(f"/v1/blocks/{k}", content=b"f" * 64)).status_code == 201
            answers = await asyncio.gather(*waiting)
            assert [r.json()["prefix"] for r in answers] == [2] * len(clients)
            assert time.monotonic() - start < LONG_MS / 1000
        finally:
            for c in clients:
                await c.aclose()
    finally:
        gw.stop()
