"""The index on both of its databases: SQLite (a real file) and PostgreSQL (a real server), migrated by alembic."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, inspect, select, text

from app.index import ABSENT, BlockRecord, Index, PartRecord, make_engine
from app.index.engine import SQLITE_MMAP_BYTES, blocking_twin
from app.index.migrate import upgrade_head
from app.index.models import Block
from tests.gateway import REPO

NS = "m_0123456789ab"


@pytest.fixture
async def index(index_url: str) -> AsyncIterator[Index]:
    await upgrade_head(index_url)
    idx = Index(make_engine(index_url), flush_interval_s=3600)  # flushes only when the test asks
    await idx.start()
    try:
        yield idx
    finally:
        await idx.close()


def key(i: int, ns: str = NS) -> str:
    return f"{ns}_r0/000/00_g0/{i:064x}.bin"


def row(
    *, key: str, size: int, digest: str, namespace: str = NS, rank: int = 0, group: int = 0, stamp: str | None = None
) -> BlockRecord:
    return BlockRecord(
        key=key,
        namespace=namespace,
        rank=rank,
        group=group,
        size=size,
        digest=digest,
        created_at=1.0,
        last_access=1.0,
        hits=0,
        stamp=stamp,
    )


async def put_row(index: Index, **fields: Any) -> None:
    """Make a row the key's (as a PUT's commit does)."""
    await index.swap_block(row(**fields))


async def test_migration_creates_schema(index_url: str) -> None:
    await upgrade_head(index_url)
    await upgrade_head(index_url)  # idempotent: a second replica starting finds it done
    engine = make_engine(index_url)
    try:
        async with engine.connect() as conn:
            tables = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
            version = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar_one()
    finally:
        await engine.dispose()
    assert {"blocks", "namespaces", "alembic_version"} <= tables
    assert version


async def test_concurrent_migrations(index_url: str) -> None:
    """Processes starting together all migrate the same empty database: replicas on PostgreSQL, the workers of
    ``kvgate serve --workers N`` on a new SQLite file (all but one failed with "table ... already exists")."""
    script = (
        "import asyncio, sys, time; from app.index.migrate import upgrade_head; "
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time())); asyncio.run(upgrade_head(sys.argv[1]))"
    )
    start_at = str(time.time() + 3.0)  # all at once, past every interpreter's start-up
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, index_url, start_at, cwd=REPO, stderr=asyncio.subprocess.PIPE
        )
        for _ in range(6)
    ]
    results = [(await p.wait(), (await p.stderr.read()).decode()[-2000:]) for p in procs if p.stderr]
    assert [rc for rc, _ in results] == [0] * 6, results
    engine = make_engine(index_url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM alembic_version"))).scalar_one() == 1
    finally:
        await engine.dispose()


async def test_upsert_get_overwrite(index: Index) -> None:
    assert await index.get(key(1)) is None
    await put_row(index, key=key(1), namespace=NS, rank=0, group=0, size=100, digest="a" * 64)
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
    await put_row(index, key=key(1), namespace=NS, rank=0, group=0, size=250, digest="b" * 64)
    rec2 = await index.get(key(1))
    assert rec2 is not None and (rec2.size, rec2.digest) == (250, "b" * 64)
    assert await index.scans.usage() == (1, 250)


async def test_large_values(index: Index) -> None:
    """BigInteger columns: sizes past 2**31 and a group id using all 32 bits."""
    await put_row(index, key=key(2), namespace=NS, rank=7, group=2**32 - 1, size=5 * 2**30, digest="c" * 64)
    rec = await index.get(key(2))
    assert rec is not None and (rec.rank, rec.group, rec.size) == (7, 2**32 - 1, 5 * 2**30)


async def test_concurrent_upserts_group_commit(index: Index) -> None:
    await asyncio.gather(
        *(put_row(index, key=key(i), namespace=NS, rank=0, group=0, size=i, digest=f"{i:064x}") for i in range(300))
    )
    assert await index.scans.usage() == (300, sum(range(300)))


async def test_get_many_in_order_and_over_batch(index: Index) -> None:
    present = [key(i) for i in range(0, 1200, 2)]  # over the 500-key IN batches
    await asyncio.gather(
        *(
            index.swap_block(
                BlockRecord(
                    key=k,
                    namespace=NS,
                    rank=0,
                    group=0,
                    size=1,
                    digest="d" * 64,
                    created_at=1.0,
                    last_access=1.0,
                    hits=0,
                )
            )
            for k in present
        )
    )
    asked = [key(i) for i in range(1200)]
    found = await index.get_many(asked)
    assert set(found) == set(present)
    assert all(found[k].key == k for k in present)


async def test_delete(index: Index) -> None:
    for i in range(3):
        await put_row(index, key=key(i), namespace=NS, rank=0, group=0, size=10, digest="e" * 64)
    gone = [await index.remove_block(k) for k in (key(0), key(1), key(99))]
    assert [g is not None for g in gone] == [True, True, False]
    assert await index.get(key(0)) is None
    assert await index.get(key(2)) is not None
    assert await index.scans.usage() == (1, 10)


async def test_empty_usage(index: Index) -> None:
    assert await index.scans.usage() == (0, 0)


async def test_namespaces(index: Index) -> None:
    fields = {"model_name": "m", "tp_size": 1, "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["a"]}]}
    assert await index.get_namespace(NS) is None
    assert await index.put_namespace(name=NS, fields=fields) is True
    assert await index.put_namespace(name=NS, fields=fields) is False
    rec = await index.get_namespace(NS)
    assert rec is not None and rec.name == NS and rec.fields == fields


async def test_access_flush(index: Index) -> None:
    await put_row(index, key=key(5), namespace=NS, rank=0, group=0, size=1, digest="f" * 64)
    await put_row(index, key=key(6), namespace=NS, rank=0, group=0, size=1, digest="f" * 64)
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


async def test_two_indexes_share_one_database(index_url: str) -> None:
    """Two replicas' Index objects over one database see each other's writes and deletes."""
    await upgrade_head(index_url)
    a, b = Index(make_engine(index_url), flush_interval_s=3600), Index(make_engine(index_url), flush_interval_s=3600)
    await a.start()
    await b.start()
    try:
        await put_row(a, key=key(7), namespace=NS, rank=0, group=0, size=42, digest="1" * 64)
        rec = await b.get(key(7))
        assert rec is not None and rec.size == 42
        b.touch(key(7))
        a.touch(key(7))
        await asyncio.gather(a.flush_access(), b.flush_access())
        rec = await a.get(key(7))
        assert rec is not None and rec.hits == 2
        assert await b.remove_block(key(7)) is not None
        assert await a.get(key(7)) is None
    finally:
        await a.close()
        await b.close()


async def test_run_read(index: Index) -> None:
    await put_row(index, key=key(8), namespace=NS, rank=0, group=0, size=9, digest="2" * 64)

    async def count(conn: object) -> int:
        return int((await conn.execute(select(func.count()).select_from(Block))).scalar_one())  # type: ignore[attr-defined]

    assert await index.run_read(count) == 1


async def test_swap_block_reads_what_it_replaces(index: Index) -> None:
    first = await index.swap_block(row(key=key(20), size=5, digest="a" * 64, stamp="s1"))
    assert first.old is None and first.written
    again = await index.swap_block(row(key=key(20), size=6, digest="b" * 64, stamp="s2"), expect=ABSENT)
    assert not again.written and again.old is not None and again.old.stamp == "s1"  # create-only: present
    same = await index.swap_block(row(key=key(20), size=5, digest="a" * 64, stamp="s3"))
    assert not same.written  # the same bytes: nothing to change
    swap = await index.swap_block(row(key=key(20), size=6, digest="b" * 64, stamp="s2"))
    assert swap.written and swap.old is not None and (swap.old.digest, swap.old.stamp) == ("a" * 64, "s1")
    # a change decided from an earlier look commits only while the row still names the version it saw
    stale = await index.swap_block(row(key=key(20), size=5, digest="a" * 64, stamp="s4"), expect="s1")
    assert not stale.written and stale.old is not None and stale.old.stamp == "s2"
    current = await index.swap_block(row(key=key(20), size=5, digest="a" * 64, stamp="s4"), expect="s2")
    assert current.written
    rec = await index.get(key(20))
    assert rec is not None and (rec.size, rec.digest, rec.stamp) == (5, "a" * 64, "s4")
    # removal of one version only
    assert await index.remove_block(key(20), expect="s2") is None
    gone = await index.remove_block(key(20), expect="s4")
    assert gone is not None and gone.digest == "a" * 64
    assert await index.get(key(20)) is None and await index.remove_block(key(20)) is None


async def test_usage_moves_in_each_change_s_transaction(index: Index) -> None:
    """The usage table (kept by triggers) equals the rows and stored parts after every kind of change."""

    async def truth() -> dict[str, tuple[int, int]]:
        blocks = {u.namespace: (u.blocks, u.bytes) for u in await index.scans.namespace_usage()}
        for upload in await index.scans.uploads():
            b, n = blocks.get(upload.namespace, (0, 0))
            blocks[upload.namespace] = (b, n + upload.bytes)
        return {ns: v for ns, v in blocks.items() if v != (0, 0)}

    other = "other_model_0123456789ab"
    await asyncio.gather(*(index.swap_block(row(key=key(i), size=10 + i, digest=f"{i:064x}")) for i in range(40)))
    await index.swap_block(row(key=key(5, ns=other), size=7, digest="7" * 64, namespace=other))
    await index.swap_block(row(key=key(3), size=1000, digest="f" * 64))  # an overwrite: another size
    await index.remove_block(key(4))
    part = PartRecord(key=key(90), start=0, end=300, total=600, digest="9" * 64, store_key="x")
    recorded = await index.add_part(part, namespace=NS)
    assert recorded is not None
    assert await index.scans.usage_by_namespace() == await truth()
    assert (await index.scans.usage_by_namespace())[NS] == (39, sum(10 + i for i in range(40)) - 13 + 1000 - 14 + 300)
    assert await index.delete_parts(key(90), recorded) == 1
    for i in range(40):
        await index.remove_block(key(i))
    assert await index.scans.usage_by_namespace() == await truth() == {other: (1, 7)}


async def test_create_only_has_one_winner_across_two_indexes(index_url: str) -> None:
    """Two gateways' indexes over one database: concurrent create-only swaps of a key, exactly one is written."""
    await upgrade_head(index_url)
    a, b = Index(make_engine(index_url)), Index(make_engine(index_url))
    await a.start()
    await b.start()
    try:
        for i in range(20):
            k = key(1000 + i)
            swaps = await asyncio.gather(
                *(
                    idx.swap_block(row(key=k, size=w, digest=f"{w:064x}", stamp=str(w)), expect=ABSENT)
                    for w, idx in enumerate([a, b] * 4)
                )
            )
            assert sum(s.written for s in swaps) == 1
            rec = await a.get(k)
            winner = next(w for w, s in enumerate(swaps) if s.written)
            assert rec is not None and rec.stamp == str(winner)
            # and each overwrite saw exactly the row it replaced: the stamps form one chain
            olds = await asyncio.gather(
                *(
                    idx.swap_block(row(key=k, size=100 + w, digest=f"{100 + w:064x}", stamp=f"o{w}"))
                    for w, idx in enumerate([a, b] * 4)
                )
            )
            seen = sorted(str(s.old.stamp) for s in olds if s.old is not None)
            final = await a.get(k)
            assert final is not None
            assert sorted([str(winner), *(f"o{w}" for w in range(8))]) == sorted([*seen, str(final.stamp)])
    finally:
        await a.close()
        await b.close()


async def test_sqlite_engines_read_through_a_memory_map(tmp_path: Path) -> None:
    """Both SQLite engines, the async one and the blocking twin the reader threads use, map the file for reads
    (PRAGMA mmap_size; without it every page a probe misses in a connection's small cache is a read() call)."""
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'index.db'}")
    twin = blocking_twin(engine)
    assert twin is not None
    try:
        async with engine.connect() as conn:
            assert (await conn.exec_driver_sql("PRAGMA mmap_size")).scalar_one() == SQLITE_MMAP_BYTES
        with twin.connect() as sync_conn:
            assert sync_conn.exec_driver_sql("PRAGMA mmap_size").scalar_one() == SQLITE_MMAP_BYTES
    finally:
        await engine.dispose()
        twin.dispose()


async def test_sqlite_many_probes_the_keys_as_they_come(tmp_path: Path) -> None:
    """The SQLite form of get_many/sizes_many walks the JSON array and probes the primary key per key: no
    temporary B-tree of the keys first (``IN (SELECT value FROM json_each(?))`` built one, a fifth of the time)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'index.db'}"
    await upgrade_head(url)
    idx = Index(make_engine(url), flush_interval_s=3600)
    try:
        async with idx.engine.connect() as conn:
            for sql in (idx._sizes_many_bound, idx._get_many_bound):
                plan = [r[-1] for r in (await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", ("[]",))).all()]
                assert len(plan) == 2 and plan[0].startswith("SCAN j"), plan
                assert plan[1].startswith("SEARCH blocks USING INDEX sqlite_autoindex_blocks_1 (key=?)"), plan
    finally:
        await idx.engine.dispose()
