"""Same-key races against a real gateway process (filesystem + SQLite): one linear history per key.

Each test drives many concurrent clients at a few keys, checks every answer against its own ETag while it runs
(tests/e2e/races.py), and at the end checks that HEAD, GET, lookup, ``/v1/stats``, the SQLite rows and the files on
disk all describe the same version of every key.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for, random_bytes
from tests.e2e.races import Ledger, assert_fs_agrees, assert_http_agrees, assert_stats_exact, sha, while_reading
from tests.gateway import Gateway, settled_stats

PUTS = 25
"""PUTs per writer."""


async def same_key_writers(
    urls: list[str], keys: list[str], ledger: Ledger, *, writers: int, sizes: list[int], puts: int
) -> dict[str, set[str]]:
    """``writers`` clients PUT ``puts`` distinct bodies each to random ``keys``; key -> digests acknowledged."""
    acked: dict[str, set[str]] = {k: set() for k in keys}

    async def one(w: int) -> None:
        async with httpx.AsyncClient(base_url=urls[w % len(urls)], timeout=30) as c:
            for seq in range(puts):
                key = random.choice(keys)
                data = random_bytes(random.choice(sizes), w * 1_000_003 + seq)
                digest = ledger.add(data)
                r = await c.put(f"/v1/blocks/{key}", content=data)
                ledger.statuses[f"PUT {r.status_code}"] += 1
                if r.status_code in (200, 201):
                    if r.headers["etag"].strip('"') != digest:
                        ledger.wrong(f"PUT {key}: acknowledged with ETag {r.headers['etag'][:14]} for {digest[:12]}")
                    acked[key].add(digest)
                elif r.status_code not in (503, 507):
                    ledger.wrong(f"PUT {key}: {r.status_code} {r.text[:200]}")

    await asyncio.gather(*(one(w) for w in range(writers)))
    return acked


@pytest.mark.parametrize("sizes", [[64 * 1024], [1000, 64 * 1024, 300 * 1024]], ids=["same-size", "mixed-size"])
def test_same_key_writers_and_readers(gateway: Gateway, sizes: list[int]) -> None:
    """16 writers put different bodies to 2 keys while 8 readers GET, Range-GET and HEAD them."""
    keys = [key_for(1), key_for(2)]
    ledger = Ledger()

    writes = same_key_writers([gateway.url], keys, ledger, writers=16, sizes=sizes, puts=PUTS)
    acked = asyncio.run(while_reading(writes, [gateway.url], keys, ledger, n=8))
    assert not ledger.errors, (ledger.errors[:10], ledger.statuses)
    assert ledger.statuses["GET 200"] > 20 and ledger.statuses["PUT 201"] + ledger.statuses["PUT 200"] > 100, (
        ledger.statuses
    )
    present = assert_http_agrees(gateway.url, keys, ledger)
    assert set(present) == set(keys)
    for key, digest in present.items():
        assert digest in acked[key]
    rows = assert_fs_agrees(gateway.data_dir)
    assert {k: d for k, (_, d) in rows.items()} == present
    assert_stats_exact(gateway.url, rows)


def test_put_delete_put_jitter(gateway: Gateway) -> None:
    """PUT a, DELETE, PUT b of each key, each jittered by up to 20 ms: no acknowledged PUT loses its bytes."""
    keys = [key_for(i) for i in range(300)]
    ledger = Ledger()
    done: dict[str, list[tuple[float, str, str]]] = {k: [] for k in keys}  # key -> (acked at, op, digest)

    async def race() -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=httpx.Timeout(60.0, pool=None), limits=limits) as c:

            async def op(key: str, kind: str, data: bytes | None) -> None:
                await asyncio.sleep(random.random() * 0.02)
                if kind == "put":
                    assert data is not None
                    r = await c.put(f"/v1/blocks/{key}", content=data)
                    if r.status_code in (200, 201):
                        done[key].append((time.monotonic(), "put", sha(data)))
                    else:
                        ledger.wrong(f"PUT {key}: {r.status_code}")
                else:
                    r = await c.delete(f"/v1/blocks/{key}")
                    if r.status_code in (204, 404):
                        done[key].append((time.monotonic(), "delete", ""))
                    else:
                        ledger.wrong(f"DELETE {key}: {r.status_code}")

            tasks = []
            for i, key in enumerate(keys):
                a, b = random_bytes(20_000, 2 * i), random_bytes(20_000, 2 * i + 1)
                ledger.add(a)
                ledger.add(b)
                tasks += [op(key, "put", a), op(key, "delete", None), op(key, "put", b)]
            random.shuffle(tasks)
            await asyncio.gather(*tasks)

    asyncio.run(race())
    assert not ledger.errors, ledger.errors[:10]
    present = assert_http_agrees(gateway.url, keys, ledger)
    rows = assert_fs_agrees(gateway.data_dir)
    assert {k: d for k, (_, d) in rows.items()} == present
    for key in keys:
        # the state is that of an acknowledged operation; a key present holds one of the bodies acknowledged for it
        acked_puts = {d for _, kind, d in done[key] if kind == "put"}
        if key in present:
            assert present[key] in acked_puts, key
        else:  # absent: a DELETE was acknowledged (whatever its order, the last acknowledged op can be it)
            assert any(kind == "delete" for _, kind, _ in done[key]), key
    assert_stats_exact(gateway.url, rows)


def test_create_only_has_one_winner(gateway: Gateway) -> None:
    """16 concurrent ``If-None-Match: *`` PUTs of one new key, 30 rounds: exactly one 201 each round."""

    async def race() -> list[tuple[int, int, str]]:
        results = []
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as c:
            for rnd in range(30):
                key = key_for(10_000 + rnd)
                bodies = [random_bytes(8192, rnd * 100 + w) for w in range(16)]
                rs = await asyncio.gather(
                    *(c.put(f"/v1/blocks/{key}", content=b, headers={"If-None-Match": "*"}) for b in bodies)
                )
                codes = [r.status_code for r in rs]
                winners = [sha(b) for b, r in zip(bodies, rs, strict=True) if r.status_code == 201]
                got = await c.get(f"/v1/blocks/{key}")
                results.append((codes.count(201), codes.count(412), winners[0] if winners else ""))
                assert sha(got.content) == (winners[0] if winners else None), (rnd, codes)
        return results

    results = asyncio.run(race())
    assert [(w, lost) for w, lost, _ in results] == [(1, 15)] * 30
    assert_stats_exact(gateway.url, assert_fs_agrees(gateway.data_dir))


def test_eviction_races_gets_and_puts(tmp_path: Path) -> None:
    """A 40-block bound, writers overwriting 120 keys, readers: usage stays the sum of the rows, always."""
    block = 32 * 1024
    gw = Gateway(
        tmp_path / "data",
        env={"KVGATE_MAX_BYTES": str(40 * block), "KVGATE_EVICTION_INTERVAL_S": "0.05", "KVGATE_EVICTION_BATCH": "8"},
    ).start()
    keys = [key_for(i) for i in range(120)]
    ledger = Ledger()
    try:
        writes = same_key_writers([gw.url], keys, ledger, writers=12, sizes=[block], puts=PUTS)
        asyncio.run(while_reading(writes, [gw.url], keys, ledger, n=6))
        assert not ledger.errors, (ledger.errors[:10], ledger.statuses)
        assert ledger.statuses["PUT 201"] + ledger.statuses["PUT 200"] > 100, ledger.statuses
        with httpx.Client(base_url=gw.url) as c:
            settled_stats(c)
        present = assert_http_agrees(gw.url, keys, ledger)
        rows = assert_fs_agrees(gw.data_dir)
        assert {k: d for k, (_, d) in rows.items()} == present
        assert sum(s for s, _ in rows.values()) <= 40 * block
        assert_stats_exact(gw.url, rows)
        stats = httpx.get(f"{gw.url}/v1/stats").json()
        assert stats["evictions"] > 0
    finally:
        gw.stop()
