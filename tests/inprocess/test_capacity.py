"""Capacity in process: the bound holds, 507 for what can never fit, LRU order (GET counts, HEAD and lookup do not),
namespace quotas. ``settle`` runs the eviction round the last PUT kicked instead of waiting for the background task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.core.coordination import open_coordinator
from tests.capacity.helpers import block_files, index_rows
from tests.conftest import crc, key_for, random_bytes
from tests.inprocess.harness import InProcessGateway, running, settings_for

BLOCK = 4096
OTHER_NS = "other_model_0123456789ab"


async def settle(gw: InProcessGateway) -> dict[str, Any]:
    """Stats once the eviction round that the last PUT kicked has run (the lock orders it after the task's)."""
    await gw.capacity.enforce()
    return await gw.stats()


async def present(gw: InProcessGateway, ids: range) -> set[int]:
    return {i for i in ids if (await gw.client.head(f"/v1/blocks/{key_for(i)}")).status_code == 200}


async def test_fill_past_capacity_keeps_the_bound(tmp_path: Path) -> None:
    cap = 20
    async with running(settings_for(tmp_path, fs=True, max_bytes=cap * BLOCK)) as gw:
        bodies = {i: random_bytes(BLOCK, seed=i) for i in range(60)}
        for i, body in bodies.items():
            r = await gw.client.put(f"/v1/blocks/{key_for(i)}", content=body)
            assert r.status_code == 201, r.text
            assert gw.capacity.usage.bytes <= cap * BLOCK, i  # admission evicts before the write
        stats = await settle(gw)
        assert stats["usage_bytes"] == stats["blocks"] * BLOCK <= cap * BLOCK * 0.95  # under the high mark
        assert stats["evictions"] == 60 - stats["blocks"]
        kept = await present(gw, range(60))
        assert kept == set(range(60 - stats["blocks"], 60))  # nothing was read: the oldest went first
        for i in sorted(kept):
            got = await gw.client.get(f"/v1/blocks/{key_for(i)}")
            assert got.content == bodies[i] and got.headers["etag"] == f'"{crc(bodies[i])}"'
        for i in set(range(60)) - kept:
            assert (await gw.client.get(f"/v1/blocks/{key_for(i)}")).status_code == 404
    rows, files = index_rows(tmp_path), block_files(tmp_path)
    assert rows == files and set(rows) == {key_for(i) for i in kept}


async def test_too_large_for_capacity_is_507_and_evicts_nothing(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, max_bytes=4 * BLOCK)) as gw:
        for i in range(3):
            assert (await gw.client.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(BLOCK, i))).status_code == 201
        r = await gw.client.put(f"/v1/blocks/{key_for(99)}", content=b"z" * (4 * BLOCK + 1))
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"
        assert (await gw.client.head(f"/v1/blocks/{key_for(99)}")).status_code == 404
        assert await present(gw, range(3)) == {0, 1, 2}
        stats = await gw.stats()
        assert stats["evictions"] == 0 and stats["usage_bytes"] == 3 * BLOCK


async def test_object_too_large_for_capacity_refuses_its_last_part(tmp_path: Path) -> None:
    total = 4 * BLOCK + 1
    async with running(settings_for(tmp_path, max_bytes=4 * BLOCK)) as gw:
        spans = [(0, BLOCK), (BLOCK, total)]
        statuses = []
        for start, end in spans:
            headers = {"Content-Range": f"bytes {start}-{end - 1}/{total}"}
            r = await gw.client.put(f"/v1/blocks/{key_for(98)}", content=b"p" * (end - start), headers=headers)
            statuses.append(r.status_code)
        assert statuses[-1] == 507  # the bound holds: the object is never published
        assert (await gw.client.head(f"/v1/blocks/{key_for(98)}")).status_code == 404
        assert gw.capacity.usage.bytes <= 4 * BLOCK


async def test_part_of_object_too_large_for_capacity_is_507_at_once(tmp_path: Path) -> None:
    total = 4 * BLOCK + 1
    async with running(settings_for(tmp_path, max_bytes=4 * BLOCK)) as gw:
        headers = {"Content-Range": f"bytes 0-{BLOCK - 1}/{total}"}
        r = await gw.client.put(f"/v1/blocks/{key_for(98)}", content=b"p" * BLOCK, headers=headers)
        assert r.status_code == 507
        assert (await gw.stats())["usage_bytes"] == 0


async def test_lru_order_get_counts_head_and_lookup_do_not(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, max_bytes=10 * BLOCK)) as gw:
        c = gw.client
        for i in range(9):
            assert (await c.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(BLOCK, i))).status_code == 201
        for _ in range(3):
            assert (await c.head(f"/v1/blocks/{key_for(0)}")).status_code == 200
            assert (await c.post("/v1/lookup", json={"keys": [key_for(0)]})).json()["prefix"] == 1
        assert (await c.get(f"/v1/blocks/{key_for(1)}")).status_code == 200  # only GET makes a block recent
        for i in range(9, 12):
            assert (await c.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(BLOCK, i))).status_code == 201
        stats = await settle(gw)
        # 12 blocks into 10: over the high mark (9.5) -> down to the low one (8.5), oldest unread first
        assert await present(gw, range(12)) == {1, 5, 6, 7, 8, 9, 10, 11}
        assert stats["evictions"] == 4 and stats["evicted_bytes"] == 4 * BLOCK
        assert stats["usage_bytes"] == 8 * BLOCK


async def test_namespace_quota_evicts_only_that_namespace(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, namespace_quota_bytes=10 * BLOCK)) as gw:
        c = gw.client
        for i in range(8):
            assert (
                await c.put(f"/v1/blocks/{key_for(i, namespace=OTHER_NS)}", content=b"o" * BLOCK)
            ).status_code == 201
        for i in range(30):
            assert (await c.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(BLOCK, i))).status_code == 201
        await settle(gw)
        ns = {n["namespace"]: n for n in (await c.get("/v1/namespaces")).json()["namespaces"]}
        assert ns[OTHER_NS]["blocks"] == 8  # under its quota: untouched
        from tests.conftest import TEST_NS

        assert ns[TEST_NS]["bytes"] <= 10 * BLOCK * 0.85
        assert (await c.head(f"/v1/blocks/{key_for(29)}")).status_code == 200
        assert (await c.head(f"/v1/blocks/{key_for(0)}")).status_code == 404
        r = await c.put(f"/v1/blocks/{key_for(99)}", content=b"q" * (10 * BLOCK + 1))
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"


async def test_usage_follows_deletes_and_replacements(gw: InProcessGateway) -> None:
    c = gw.client
    assert (await c.put(f"/v1/blocks/{key_for(1)}", content=b"a" * 1000)).status_code == 201
    assert (await c.put(f"/v1/blocks/{key_for(2)}", content=b"b" * 500)).status_code == 201
    assert (await c.put(f"/v1/blocks/{key_for(1)}", content=b"c" * 300)).status_code == 200
    stats = await gw.stats()
    assert (stats["blocks"], stats["usage_bytes"]) == (2, 800)
    assert (await c.delete(f"/v1/blocks/{key_for(2)}")).status_code == 204
    stats = await gw.stats()
    assert (stats["blocks"], stats["usage_bytes"]) == (1, 300)
    assert (gw.capacity.usage.blocks, gw.capacity.usage.bytes) == (1, 300)


async def test_stats_say_evicting_while_another_process_of_the_machine_evicts(tmp_path: Path) -> None:
    """``evicting`` in /v1/stats is true while any process on this machine runs an eviction round (it holds the
    coordination file's ``evict`` lock), not only this one: a worker that reads usage under the high mark while
    another worker's round goes on to the low one is not settled."""
    settings = settings_for(tmp_path, fs=True, max_bytes=20 * BLOCK)
    async with running(settings) as gw:
        assert (await gw.stats())["evicting"] is False
        other = open_coordinator(settings.data_dir)  # another process's description of the same file
        try:
            fd = other.try_exclusive("evict")
            assert fd is not None
            assert (await gw.stats())["evicting"] is True
            other.release_exclusive("evict", fd)
            assert (await gw.stats())["evicting"] is False
        finally:
            other.close()
