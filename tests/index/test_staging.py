"""Staging intents (app/index/staging.py) on both databases: a swept version is never committed, a committed one
never swept, an object being staged never swept, whatever the callers' clocks; parts alike."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import inspect

from alembic import command
from app.index import FENCED, Index, PartRecord, make_engine
from app.index.migrate import alembic_config, upgrade_head
from tests.index.test_index_dialects import NS, key, row


@pytest.fixture
async def index(index_url: str) -> AsyncIterator[Index]:
    await upgrade_head(index_url)
    idx = Index(make_engine(index_url), flush_interval_s=3600)
    await idx.start()
    try:
        yield idx
    finally:
        await idx.close()


async def test_the_clock_is_the_databases(index: Index) -> None:
    assert (
        abs(await index.staging.db_now() - time.time()) < 60
    )  # the same machine here: the same time, by another clock


async def test_a_swept_version_is_never_committed(index: Index) -> None:
    k = key(1)
    await index.staging.add_intent(key=k, stamp="s1")
    assert not await index.staging.claim_version(key=k, stamp="s1", older_than_s=3600)  # being staged: kept
    assert await index.staging.claim_version(key=k, stamp="s1", older_than_s=0)  # old by the database's clock: taken
    swap = await index.swap_block(row(key=k, size=4, digest="a" * 64, stamp="s1"), intent="s1")
    assert swap.fenced and not swap.written
    assert await index.get(k) is None


async def test_a_committed_version_is_never_swept(index: Index) -> None:
    k = key(2)
    await index.staging.add_intent(key=k, stamp="s1")
    swap = await index.swap_block(row(key=k, size=4, digest="a" * 64, stamp="s1"), intent="s1")
    assert swap.written and not swap.fenced
    assert not await index.staging.claim_version(key=k, stamp="s1", older_than_s=0)  # the row names it
    assert await index.staging.expired_intents(older_than_s=0) == []  # the commit took its intent
    # replaced: the old version is no longer named, and nothing can commit it again
    await index.staging.add_intent(key=k, stamp="s2")
    assert (await index.swap_block(row(key=k, size=4, digest="b" * 64, stamp="s2"), intent="s2")).written
    assert await index.staging.claim_version(key=k, stamp="s1", older_than_s=3600)
    assert not await index.staging.claim_version(key=k, stamp="s2", older_than_s=0)


async def test_a_part_object_is_fenced_the_same_way(index: Index) -> None:
    k = key(3)
    part = PartRecord(key=k, start=0, end=4, total=8, digest="a" * 64, store_key=f"_parts/{k}/0-4.x", created_at=0.0)
    await index.staging.add_intent(key=part.store_key)
    assert not await index.staging.claim_part_object(store_key=part.store_key, older_than_s=3600)
    assert await index.staging.claim_part_object(store_key=part.store_key, older_than_s=0)
    assert await index.add_part(part, namespace=NS, intent=True) is FENCED
    assert await index.get_parts(k) == []
    other = PartRecord(key=k, start=0, end=4, total=8, digest="a" * 64, store_key=f"_parts/{k}/0-4.y", created_at=0.0)
    await index.staging.add_intent(key=other.store_key)
    recorded = await index.add_part(other, namespace=NS, intent=True)
    assert recorded is not FENCED and recorded is not None and [p.store_key for p in recorded] == [other.store_key]
    assert abs(recorded[0].created_at - await index.staging.db_now()) < 60  # timed by the database's clock
    assert not await index.staging.claim_part_object(store_key=other.store_key, older_than_s=0)  # a row describes it


async def test_0008_adds_the_staging_table_and_back(index_url: str) -> None:
    cfg = alembic_config(index_url)
    await asyncio.to_thread(command.upgrade, cfg, "0007")
    engine = make_engine(index_url)
    try:

        async def tables() -> set[str]:
            async with engine.connect() as conn:
                return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))

        assert "staging" not in await tables()
        await upgrade_head(index_url)
        assert "staging" in await tables()
        await asyncio.to_thread(command.downgrade, cfg, "0007")
        assert "staging" not in await tables()
    finally:
        await engine.dispose()
