"""Scale-out: two gateway processes over one S3 bucket (on moto, and on SeaweedFS) and one PostgreSQL index; S3
outages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from contract.keys import namespace_for
from tests.conftest import TEST_NS, key_for, matches, random_bytes, sha, token_as
from tests.gateway import Gateway
from tests.services import S3_SERVERS, PgServer, S3TestServer, own_s3_server, start_or_skip, unique_bucket

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, s3_server: S3TestServer, pg_server: PgServer
) -> Iterator[tuple[Gateway, Gateway]]:
    """Two gateways started together (both migrate the one fresh database at once) over one bucket and one index."""
    db_url = asyncio.run(pg_server.create_database())
    env = {**s3_server.backend_env(bucket=unique_bucket(), prefix="kv"), "KVGATE_DB_URL": db_url}
    root = tmp_path_factory.mktemp("replicas")
    gateways = (Gateway(root / "a", env=env), Gateway(root / "b", env=env))
    try:
        with ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(g.start) for g in gateways]:
                started.result()
        yield gateways
    finally:
        for g in gateways:
            g.stop()
        asyncio.run(pg_server.drop_database(db_url))


def test_write_through_one_read_through_other(replicas: tuple[Gateway, Gateway]) -> None:
    a, b = replicas
    blocks = {key_for(1): random_bytes(2 * MiB, 1), key_for(2): random_bytes(9 * MiB + 5, 2)}  # 9 MiB: multipart
    with httpx.Client(base_url=a.url, timeout=30) as ca, httpx.Client(base_url=b.url, timeout=30) as cb:
        for key, data in blocks.items():
            r = ca.put(f"/v1/blocks/{key}", content=data, headers={"X-KVGate-SHA256": sha(data)})
            assert r.status_code == 201, r.text
        for key, data in blocks.items():
            h = cb.head(f"/v1/blocks/{key}")
            assert h.status_code == 200
            assert int(h.headers["Content-Length"]) == len(data)
            g = cb.get(f"/v1/blocks/{key}")
            assert g.status_code == 200 and g.content == data
            assert g.headers["ETag"] == h.headers["ETag"]
        part = cb.get(f"/v1/blocks/{key_for(2)}", headers={"Range": "bytes=4194300-8388700"})
        assert part.status_code == 206 and part.content == blocks[key_for(2)][4194300:8388701]
        look = cb.post("/v1/lookup", json={"keys": [key_for(1), key_for(2), key_for(3)]})
        assert look.status_code == 200 and look.json()["prefix"] == 2

        # an identical re-put through the other replica is recognised from the shared index
        again = cb.put(
            f"/v1/blocks/{key_for(1)}", content=blocks[key_for(1)], headers={"X-KVGate-SHA256": sha(blocks[key_for(1)])}
        )
        assert again.status_code == 200

        # delete through A: a miss through B, on HEAD, GET and lookup
        assert ca.delete(f"/v1/blocks/{key_for(1)}").status_code in (200, 204)
        assert cb.head(f"/v1/blocks/{key_for(1)}").status_code == 404
        miss = cb.get(f"/v1/blocks/{key_for(1)}")
        assert miss.status_code == 404 and miss.json()["error"]["code"] == "not_found"
        assert cb.post("/v1/lookup", json={"keys": [key_for(1), key_for(2)]}).json()["prefix"] == 0
        assert cb.get(f"/v1/blocks/{key_for(2)}").content == blocks[key_for(2)]


def test_overwrite_is_never_served_stale(replicas: tuple[Gateway, Gateway]) -> None:
    a, b = replicas
    key = key_for(10)
    old, new = random_bytes(300_000, 10), random_bytes(200_000, 11)
    with httpx.Client(base_url=a.url, timeout=30) as ca, httpx.Client(base_url=b.url, timeout=30) as cb:
        assert ca.put(f"/v1/blocks/{key}", content=old).status_code == 201
        for _ in range(3):  # warm whatever A might cache
            assert matches(ca.head(f"/v1/blocks/{key}").headers["ETag"], old)
            assert ca.get(f"/v1/blocks/{key}").content == old
        assert cb.put(f"/v1/blocks/{key}", content=new).status_code in (200, 201)
        h = ca.head(f"/v1/blocks/{key}")
        assert int(h.headers["Content-Length"]) == len(new)
        assert matches(h.headers["ETag"], new)
        assert ca.get(f"/v1/blocks/{key}").content == new
        assert cb.delete(f"/v1/blocks/{key}").status_code in (200, 204)
        assert ca.head(f"/v1/blocks/{key}").status_code == 404
        assert ca.get(f"/v1/blocks/{key}").status_code == 404


def test_namespace_config_shared(replicas: tuple[Gateway, Gateway]) -> None:
    a, b = replicas
    fields = {
        "model_name": "test-org/test-model",
        "tokens_per_hash": 16,
        "blocks_per_file": 1,
        "tp_size": 1,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "dtype": "bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["layer.0"]}],
        "inference_engine": "vllm",
    }
    with httpx.Client(base_url=a.url, timeout=30) as ca, httpx.Client(base_url=b.url, timeout=30) as cb:
        assert namespace_for(fields) == TEST_NS  # these are TEST_NS's own fields: a 409 is a contract failure
        put = ca.put(f"/v1/namespaces/{TEST_NS}/config", json=fields)
        assert put.status_code == 201, put.text
        got = cb.get(f"/v1/namespaces/{TEST_NS}/config")
        assert got.status_code == 200 and got.json() == fields


async def _recreate_bucket(server: S3TestServer, bucket: str) -> None:
    async with server.client() as s3:
        await s3.create_bucket(Bucket=bucket)


@pytest.mark.parametrize("kind", S3_SERVERS)
def test_s3_outage_is_503_and_recovers(tmp_path: Path, kind: str) -> None:
    store = start_or_skip(own_s3_server(kind, root=tmp_path))
    bucket = unique_bucket()
    gw = Gateway(tmp_path / "data", env=store.backend_env(bucket=bucket))
    try:
        gw.start()
        data = random_bytes(100_000, 20)
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            assert c.put(f"/v1/blocks/{key_for(20)}", content=data).status_code == 201
            store.kill()

            put = c.put(f"/v1/blocks/{key_for(21)}", content=data)
            assert put.status_code == 503, put.text
            assert put.headers["Retry-After"]
            assert put.json()["error"]["code"] == "backend_unavailable"
            get = c.get(f"/v1/blocks/{key_for(20)}")
            assert get.status_code == 503, get.text  # an outage, never a miss
            assert get.headers["Retry-After"]
            ready = c.get("/readyz")
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "backend_unavailable"
            # the failed PUT left no index row behind
            assert c.post("/v1/lookup", json={"keys": [key_for(21)]}).json()["prefix"] == 0

            store.start()  # the same port; moto comes back empty (the bucket is made again), SeaweedFS whole
            if kind == "moto":
                asyncio.run(_recreate_bucket(store, bucket))
            assert c.get("/readyz").status_code == 200
            fresh = random_bytes(3 * MiB, 22)
            assert c.put(f"/v1/blocks/{key_for(22)}", content=fresh).status_code == 201
            back = c.get(f"/v1/blocks/{key_for(22)}")
            assert back.status_code == 200 and back.content == fresh
            before = c.get(f"/v1/blocks/{key_for(20)}")
            if kind == "moto":  # the block written before the outage is gone with moto's memory: a plain miss
                assert before.status_code == 404
            else:  # SeaweedFS kept it
                assert before.status_code == 200 and before.content == data
    finally:
        gw.stop()
        store.stop()


# -- same-key races across the two replicas ---------------------------------------------------------------------


async def _s3_objects(server: S3TestServer, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` in the bucket, name (without the prefix) -> bytes."""
    found: dict[str, bytes] = {}
    async with server.client() as s3:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        async for page in pages:
            for obj in page.get("Contents", ()):
                try:
                    body = await s3.get_object(Bucket=bucket, Key=obj["Key"])
                except s3.exceptions.NoSuchKey:
                    continue  # a retired version deleted between the listing and the read
                async with body["Body"] as stream:
                    found[obj["Key"][len(prefix) :]] = await stream.read()
    return found


async def _pg_rows(db_url: str) -> dict[str, tuple[int, str, str | None]]:
    import asyncpg  # type: ignore[import-untyped]

    from tests.services import asyncpg_dsn

    conn = await asyncpg.connect(asyncpg_dsn(db_url))
    try:
        return {r["key"]: (r["size"], r["digest"], r["stamp"]) for r in await conn.fetch("select * from blocks")}
    finally:
        await conn.close()


@pytest.fixture
def racing_replicas(
    tmp_path: Path, s3_server: S3TestServer, pg_server: PgServer
) -> Iterator[tuple[Gateway, Gateway, str, str]]:
    db_url = asyncio.run(pg_server.create_database())
    bucket = unique_bucket()
    env = {**s3_server.backend_env(bucket=bucket, prefix="kv"), "KVGATE_DB_URL": db_url}
    gateways = (Gateway(tmp_path / "a", env=env), Gateway(tmp_path / "b", env=env))
    try:
        for g in gateways:
            g.start()
        yield gateways[0], gateways[1], bucket, db_url
    finally:
        for g in gateways:
            g.stop()
        asyncio.run(pg_server.drop_database(db_url))


def test_same_key_races_across_replicas(
    racing_replicas: tuple[Gateway, Gateway, str, str], s3_server: S3TestServer
) -> None:
    """Writers and readers on both replicas, two keys: every answer one whole version; S3 and PostgreSQL agree."""
    from tests.e2e.races import Ledger, assert_http_agrees, while_reading
    from tests.e2e.test_races import same_key_writers

    a, b, bucket, db_url = racing_replicas
    urls, keys, ledger = [a.url, b.url], [key_for(1), key_for(2)], Ledger()
    writes = same_key_writers(urls, keys, ledger, writers=8, sizes=[1000, 64 * 1024, 200 * 1024], puts=15)
    acked = asyncio.run(while_reading(writes, urls, keys, ledger, n=6))
    assert not ledger.errors, (ledger.errors[:10], ledger.statuses)
    present = assert_http_agrees(a.url, keys, ledger)
    assert assert_http_agrees(b.url, keys, ledger) == present
    assert set(present) == set(keys) and all(present[k] in acked[k] for k in keys)
    rows = asyncio.run(_pg_rows(db_url))
    named = {f"{k}.v{s}" for k, (_, _, s) in rows.items()}
    deadline = time.monotonic() + 30
    while True:  # replaced versions are deleted a few seconds after their row stopped naming them
        objects = asyncio.run(_s3_objects(s3_server, bucket, "kv/"))
        stale = {n for n in objects if ".bin" in n} - named
        if not stale or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not stale, f"{len(stale)} version objects no row names"
    for key, (size, digest, stamp) in rows.items():
        data = objects[f"{key}.v{stamp}"]  # the row names its version's own object
        assert (len(data), token_as(digest, data)) == (size, digest)


def test_create_only_across_replicas(racing_replicas: tuple[Gateway, Gateway, str, str]) -> None:
    """8 ``If-None-Match: *`` PUTs of one new key through each replica, 10 rounds: exactly one 201 in all."""
    a, b, _, _ = racing_replicas

    async def race() -> list[int]:
        wins = []
        async with httpx.AsyncClient(timeout=30) as c:
            for rnd in range(10):
                url = f"/v1/blocks/{key_for(20_000 + rnd)}"
                bodies = [random_bytes(4096, rnd * 100 + w) for w in range(16)]
                rs = await asyncio.gather(
                    *(
                        c.put((a.url if w % 2 else b.url) + url, content=body, headers={"If-None-Match": "*"})
                        for w, body in enumerate(bodies)
                    )
                )
                codes = [r.status_code for r in rs]
                assert set(codes) <= {201, 412}, codes
                winner = next(body for body, r in zip(bodies, rs, strict=True) if r.status_code == 201)
                for gw in (a, b):
                    assert (await c.get(gw.url + url)).content == winner
                wins.append(codes.count(201))
        return wins

    assert asyncio.run(race()) == [1] * 10
