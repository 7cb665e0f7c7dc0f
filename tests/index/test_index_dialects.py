"""The index on both of its databases: SQLite (a real file) and PostgreSQL (a real server), migrated by alembic."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, inspect, select, text

from app.index import BlockRecord, Index, make_engine
from app.index.migrate import upgrade_head
from app.index.models import Block
from tests.gateway import REPO

NS = "m_0123456789ab"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'index.db'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
async def index(db_url: str) -> AsyncIterator[Index]:
    await upgrade_head(db_url)
    idx = Index(make_engine(db_url), flush_interval_s=3600)  # flushes only when the test asks
    await idx.start()
    try:
        yield idx
    finally:
        await idx.close()


def key(i: int, ns: str = NS) -> str:
    return f"{ns}_r0/000/00_g0/{i:064x}.bin"


async def test_migration_creates_schema(db_url: str) -> None:
    await upgrade_head(db_url)
    await upgrade_head(db_url)  # idempotent: a second replica starting finds it done
    engine = make_engine(db_url)
    try:
        async with engine.connect() as conn:
            tables = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
            version = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar_one()
    finally:
        await engine.dispose()
    assert {"blocks", "namespaces", "alembic_version"} <= tables
    assert version


async def test_concurrent_migrations(db_url: str) -> None:
    """Replicas (processes) starting together all migrate the same empty PostgreSQL database."""
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite is one gateway's own file")
    script = "import asyncio, sys; from app.index.migrate import upgrade_head; asyncio.run(upgrade_head(sys.argv[1]))"
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, db_url, cwd=REPO, stderr=asyncio.subprocess.PIPE
        )
        for _ in range(3)
    ]
    results = [(await p.wait(), (await p.stderr.read()).decode()[-2000:]) for p in procs if p.stderr]
    assert [rc for rc, _ in results] == [0] * 3, results
    engine = make_engine(db_url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM alembic_version"))).scalar_one() == 1
    finally:
        await engine.dispose()


async def test_upsert_get_overwrite(index: Index) -> None:
    assert await index.get(key(1)) is None
    await index.upsert_block(key=key(1), namespace=NS, rank=0, group=0, size=100, digest="a" * 64)
    rec = await index.get(key(1))
    assert rec is not None
    assert (rec.key, rec.namespace, rec.rank, rec.group, rec.size, rec.digest, rec.hits) == (
        key(1),
        NS,
        0,
        0,
        100,
        "a" * 64,
        0,
    )
    await index.upsert_block(key=key(1), namespace=NS, rank=0, group=0, size=250, digest="b" * 64)
    rec2 = await index.get(key(1))
    assert rec2 is not None and (rec2.size, rec2.digest) == (250, "b" * 64)
    assert await index.usage() == (1, 250)


async def test_large_values(index: Index) -> None:
    """BigInteger columns: sizes past 2**31 and a group id using all 32 bits."""
    await index.upsert_block(key=key(2), namespace=NS, rank=7, group=2**32 - 1, size=5 * 2**30, digest="c" * 64)
    rec = await index.get(key(2))
    assert rec is not None and (rec.rank, rec.group, rec.size) == (7, 2**32 - 1, 5 * 2**30)


async def test_concurrent_upserts_group_commit(index: Index) -> None:
    await asyncio.gather(
        *(index.upsert_block(key=key(i), namespace=NS, rank=0, group=0, size=i, digest=f"{i:064x}") for i in range(300))
    )
    assert await index.usage() == (300, sum(range(300)))


async def test_get_many_in_order_and_over_batch(index: Index) -> None:
    present = [key(i) for i in range(0, 1200, 2)]  # over the 500-key IN batches
    await index.adopt_many(
        [
            BlockRecord(
                key=k, namespace=NS, rank=0, group=0, size=1, digest="d" * 64, created_at=1.0, last_access=1.0, hits=0
            )
            for k in present
        ]
    )
    asked = [key(i) for i in range(1200)]
    found = await index.get_many(asked)
    assert set(found) == set(present)
    assert all(found[k].key == k for k in present)


async def test_delete(index: Index) -> None:
    for i in range(3):
        await index.upsert_block(key=key(i), namespace=NS, rank=0, group=0, size=10, digest="e" * 64)
    assert await index.delete_blocks([key(0), key(1), key(99)]) == 2
    assert await index.delete_blocks([]) == 0
    assert await index.get(key(0)) is None
    assert await index.get(key(2)) is not None
    assert await index.usage() == (1, 10)


async def test_empty_usage(index: Index) -> None:
    assert await index.usage() == (0, 0)


async def test_namespaces(index: Index) -> None:
    fields = {"model_name": "m", "tp_size": 1, "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["a"]}]}
    assert await index.get_namespace(NS) is None
    assert await index.put_namespace(name=NS, fields=fields) is True
    assert await index.put_namespace(name=NS, fields=fields) is False
    rec = await index.get_namespace(NS)
    assert rec is not None and rec.name == NS and rec.fields == fields


async def test_access_flush(index: Index) -> None:
    await index.upsert_block(key=key(5), namespace=NS, rank=0, group=0, size=1, digest="f" * 64)
    await index.upsert_block(key=key(6), namespace=NS, rank=0, group=0, size=1, digest="f" * 64)
    before = await index.get(key(5))
    assert before is not None
    for _ in range(3):
        index.touch(key(5))
    index.touch(key(6))
    index.touch(key(404))  # a key with no row is a no-op, not an error
    await index.flush_access()
    after5, after6 = await index.get(key(5)), await index.get(key(6))
    assert after5 is not None and after6 is not None
    assert (after5.hits, after6.hits) == (3, 1)
    assert after5.last_access >= before.last_access
    await index.flush_access()  # nothing pending: no change
    again = await index.get(key(5))
    assert again is not None and again.hits == 3


async def test_two_indexes_share_one_database(db_url: str) -> None:
    """Two replicas' Index objects over one database see each other's writes and deletes."""
    await upgrade_head(db_url)
    a, b = Index(make_engine(db_url), flush_interval_s=3600), Index(make_engine(db_url), flush_interval_s=3600)
    await a.start()
    await b.start()
    try:
        await a.upsert_block(key=key(7), namespace=NS, rank=0, group=0, size=42, digest="1" * 64)
        rec = await b.get(key(7))
        assert rec is not None and rec.size == 42
        b.touch(key(7))
        a.touch(key(7))
        await asyncio.gather(a.flush_access(), b.flush_access())
        rec = await a.get(key(7))
        assert rec is not None and rec.hits == 2
        assert await b.delete_blocks([key(7)]) == 1
        assert await a.get(key(7)) is None
    finally:
        await a.close()
        await b.close()


async def test_run_read(index: Index) -> None:
    await index.upsert_block(key=key(8), namespace=NS, rank=0, group=0, size=9, digest="2" * 64)

    async def count(conn: object) -> int:
        return int((await conn.execute(select(func.count()).select_from(Block))).scalar_one())  # type: ignore[attr-defined]

    assert await index.run_read(count) == 1
