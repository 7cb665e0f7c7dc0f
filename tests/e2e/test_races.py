"""Same-key races against a real gateway (filesystem + SQLite): one linear history per key, with one process and
with two workers on one socket (``kvgate serve --workers 2``: the clients' connections land on both).

Each test drives many concurrent clients at a few keys, checks every answer against its own ETag while it runs
(tests/e2e/races.py), and at the end checks that HEAD, GET, lookup, ``/v1/stats``, the SQLite rows and the files on
disk all describe the same version of every key; with two workers, that both did a share of the work.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from contract.wire import PART_DIGEST_HEADER
from tests.conftest import key_for, random_bytes
from tests.e2e.races import (
    Ledger,
    all_served,
    assert_fs_agrees,
    assert_http_agrees,
    assert_stats_exact,
    sha,
    token,
    while_reading,
)
from tests.gateway import Gateway, settled_stats

PUTS = 25
"""PUTs per writer."""


@pytest.fixture(params=[1, 2], ids=["1-worker", "2-workers"])
def gateway(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Gateway]:
    """The embedded default (filesystem + SQLite), served by one process or by two workers on one socket."""
    gw = Gateway(tmp_path / "data", workers=request.param).start()
    before = gw.worker_cpu()
    try:
        yield gw
        if gw.workers > 1:
            all_served(gw, before)
    finally:
        gw.stop()


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
                        done[key].append((time.monotonic(), "put", token(data)))
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


def test_competing_part_writers_publish_one_recorded_part_per_range(gateway: Gateway) -> None:
    """3 TP groups store different bodies under one key at once, each as 4 rank parts (12 concurrent Content-Range
    PUTs per key, 4 keys a round, 8 rounds) while readers GET and Range-GET. Each range keeps the part recorded first
    (201/202; a competing part is 409, or 200 once the object is complete): the object published is those parts,
    whole, under its own digest, exactly one PUT completes it, and every answer a reader got is a whole version."""
    total, ranks, groups = 4 * 16384, 4, 3
    step = total // ranks
    served: list[tuple[str, str, int, bytes]] = []  # (key, ETag, start, bytes) of every 200/206 a reader got
    wrong: list[str] = []

    async def reader(c: httpx.AsyncClient, keys: list[str], stop: asyncio.Event) -> None:
        while not stop.is_set():
            key = random.choice(keys)
            a = random.randrange(0, total)
            ranged = random.random() < 0.5
            r = await c.get(f"/v1/blocks/{key}", headers={"Range": f"bytes={a}-{a + 9999}"} if ranged else {})
            tag = r.headers.get("etag", "").strip('"')
            if r.status_code == 200 and sha(r.content) != tag:
                wrong.append(f"GET {key}: body sha {sha(r.content)[:12]} under ETag {tag[:12]}")
            elif r.status_code == 206 and r.headers.get("x-kvgate-range-sha256") != sha(r.content):
                wrong.append(f"Range GET {key}: range sha differs")
            elif r.status_code not in (200, 206, 404):
                wrong.append(f"GET {key}: {r.status_code} {r.text[:200]}")
            if r.status_code in (200, 206):
                start = int(r.headers["content-range"].split()[1].split("-")[0]) if r.status_code == 206 else 0
                served.append((key, tag, start, r.content))

    async def store(c: httpx.AsyncClient, key: str, rnd: int) -> tuple[bytes, int]:
        bodies = [random_bytes(total, rnd * 1000 + g) for g in range(groups)]
        jobs = [(g, i) for g in range(groups) for i in range(ranks)]
        random.shuffle(jobs)

        async def part(g: int, i: int) -> httpx.Response:
            data = bodies[g][i * step : (i + 1) * step]
            headers = {"Content-Range": f"bytes {i * step}-{(i + 1) * step - 1}/{total}", PART_DIGEST_HEADER: sha(data)}
            return await c.put(f"/v1/blocks/{key}", content=data, headers=headers)

        rs = await asyncio.gather(*(part(g, i) for g, i in jobs))
        kept: dict[int, int] = {}  # range -> the group whose part was recorded
        for (g, i), r in zip(jobs, rs, strict=True):
            if r.status_code in (201, 202):
                assert i not in kept, f"{key}: two parts recorded for range {i}"
                kept[i] = g
            else:  # refused: its range holds another part (409), or the object was complete already (200)
                assert r.status_code == 409 or (r.status_code == 200 and r.json()["complete"]), (key, r.text)
        assert sorted(kept) == list(range(ranks)), (key, kept)
        expected = b"".join(bodies[kept[i]][i * step : (i + 1) * step] for i in range(ranks))
        done = [r for r in rs if r.status_code == 201]
        assert len(done) == 1 and done[0].headers["etag"] == f'"{sha(expected)}"', (key, [r.status_code for r in rs])
        return expected, len(done)

    async def run() -> dict[str, bytes]:
        objects: dict[str, bytes] = {}
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as c:
            for rnd in range(8):
                keys = [key_for(20_000 + rnd * 10 + k) for k in range(4)]
                stop = asyncio.Event()
                readers = [asyncio.create_task(reader(c, keys, stop)) for _ in range(4)]
                try:
                    results = await asyncio.gather(*(store(c, key, rnd * 10 + k) for k, key in enumerate(keys)))
                finally:
                    stop.set()
                    await asyncio.gather(*readers)
                objects.update({key: body for key, (body, _) in zip(keys, results, strict=True)})
        return objects

    objects = asyncio.run(run())
    assert not wrong, wrong[:10]
    assert served, "the readers saw no object"
    for key, tag, start, data in served:  # an object is written once here: every answer is a slice of it
        assert tag == sha(objects[key]) and objects[key][start : start + len(data)] == data, key
    for key, body in objects.items():
        got = httpx.get(f"{gateway.url}/v1/blocks/{key}", timeout=30)
        assert got.status_code == 200 and got.content == body, key
    rows = assert_fs_agrees(gateway.data_dir)
    assert {k: d for k, (_, d) in rows.items()} == {k: sha(b) for k, b in objects.items()}
    assert_stats_exact(gateway.url, rows)
    leftover = [p for p in (gateway.data_dir / "blocks" / "_parts").rglob("*") if p.is_file()]
    assert leftover == [], leftover[:5]


@pytest.mark.parametrize("workers", [1, 2], ids=["1-worker", "2-workers"])
def test_eviction_races_gets_and_puts(tmp_path: Path, workers: int) -> None:
    """A 40-block bound, writers overwriting 120 keys, readers: usage stays the sum of the rows, always (with two
    workers: one evictor at a time, admission by both)."""
    block = 32 * 1024
    gw = Gateway(
        tmp_path / "data",
        env={"KVGATE_MAX_BYTES": str(40 * block), "KVGATE_EVICTION_INTERVAL_S": "0.05", "KVGATE_EVICTION_BATCH": "8"},
        workers=workers,
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
        if workers == 1:  # evictions are counted by the process that made them: /v1/stats shows one worker's
            assert httpx.get(f"{gw.url}/v1/stats").json()["evictions"] > 0
    finally:
        gw.stop()
