"""Replicas over one PostgreSQL index and a real object store (SeaweedFS): the last two parts of an object landing
on two replicas at once make exactly one object; capacity and usage hold across replicas."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import key_for, matches, random_bytes
from tests.gateway import Gateway
from tests.services import SeaweedServer, asyncpg_dsn, unique_bucket

BLOCK = 64 * 1024


def _replicas(root: Path, env: dict[str, str]) -> tuple[Gateway, Gateway]:
    gateways = (Gateway(root / "a", env=env), Gateway(root / "b", env=env))
    with ThreadPoolExecutor(2) as pool:
        for started in [pool.submit(g.start) for g in gateways]:
            started.result()
    return gateways


async def _sql(db_url: str, *statements: str) -> list[Any]:
    """The rows of the last statement (each statement run on its own, in order)."""
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(asyncpg_dsn(db_url))
    try:
        rows: list[Any] = []
        for statement in statements:
            rows = list(await conn.fetch(statement))
        return rows
    finally:
        await conn.close()


def test_the_last_two_parts_on_two_replicas_make_one_object(
    tmp_path: Path, seaweedfs_server: SeaweedServer, pg_db: str
) -> None:
    """Each part is recorded in a transaction that sees the others; with both transactions slowed at their commit
    (a deferred trigger sleeping 1 s, after each has read the parts), an earlier design let each see only its own
    part: both answered 202, nobody assembled, and the object never became visible."""
    env = {**seaweedfs_server.backend_env(bucket=unique_bucket(), prefix="kv"), "KVGATE_DB_URL": pg_db}
    a, b = _replicas(tmp_path, env)
    try:
        asyncio.run(
            _sql(
                pg_db,
                "CREATE FUNCTION test_slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(1); "
                "RETURN NULL; END $$",
                "CREATE CONSTRAINT TRIGGER test_slow_parts AFTER INSERT ON parts DEFERRABLE INITIALLY DEFERRED "
                "FOR EACH ROW EXECUTE FUNCTION test_slow()",
            )
        )
        for n in range(3):
            key, blob = key_for(2000 + n), random_bytes(2 * BLOCK, 2000 + n)

            def part(gw: Gateway, start: int, key: str = key, blob: bytes = blob) -> int:
                headers = {"Content-Range": f"bytes {start}-{start + BLOCK - 1}/{2 * BLOCK}"}
                body = blob[start : start + BLOCK]
                return httpx.put(f"{gw.url}/v1/blocks/{key}", content=body, headers=headers, timeout=60).status_code

            with ThreadPoolExecutor(2) as pool:
                answers = sorted(pool.map(lambda args: part(*args), [(a, 0), (b, BLOCK)]))
            assert answers == [201, 202], answers
            for gw in (a, b):
                got = httpx.get(f"{gw.url}/v1/blocks/{key}", timeout=30)
                assert got.status_code == 200 and got.content == blob and matches(got.headers["etag"], blob)
        assert asyncio.run(_sql(pg_db, "SELECT COUNT(*) FROM parts"))[0][0] == 0
    finally:
        for gw in (a, b):
            gw.stop()


def _settled(gw: Gateway, *, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats: dict[str, Any] = httpx.get(f"{gw.url}/v1/stats", timeout=10).json()
        if (stats["usage_bytes"] <= stats["max_bytes"] * stats["high_watermark"] and not stats["evicting"]) or (
            time.monotonic() > deadline
        ):
            return stats
        time.sleep(0.1)


def test_capacity_holds_across_two_replicas(tmp_path: Path, seaweedfs_server: SeaweedServer, pg_db: str) -> None:
    """Writes through both replicas: each one's usage is the sum of the shared rows (an earlier design counted
    only its own writes, and re-read the index only when it was idle), the bound holds, and the two never evict
    more than needed between them."""
    bound = 20
    env = {
        **seaweedfs_server.backend_env(bucket=unique_bucket(), prefix="kv"),
        "KVGATE_DB_URL": pg_db,
        "KVGATE_MAX_BYTES": str(bound * BLOCK),
        "KVGATE_EVICTION_INTERVAL_S": "0.2",
    }
    a, b = _replicas(tmp_path, env)
    try:
        written = 60
        for i in range(written):
            gw = (a, b)[i % 2]
            r = httpx.put(f"{gw.url}/v1/blocks/{key_for(3000 + i)}", content=random_bytes(BLOCK, i), timeout=30)
            assert r.status_code == 201, r.text
        stats = [_settled(a), _settled(b)]
        blocks, nbytes = asyncio.run(_sql(pg_db, "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM blocks"))[0]
        for s in stats:  # each replica's figures are the shared rows'
            assert (s["blocks"], s["usage_bytes"]) == (blocks, nbytes)
        assert nbytes <= bound * BLOCK * 0.95
        assert nbytes >= bound * BLOCK * 0.85 - BLOCK  # not evicted past the low mark (one block of slack)
        assert sum(s["evictions"] for s in stats) == written - blocks
        present = sum(
            httpx.head(f"{a.url}/v1/blocks/{key_for(3000 + i)}", timeout=10).status_code == 200 for i in range(written)
        )
        assert present == blocks
    finally:
        for gw in (a, b):
            gw.stop()
