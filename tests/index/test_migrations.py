"""Migrations down and up again keep what the running code relies on, on both databases (a real SQLite file, a real
PostgreSQL server)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from sqlalchemy import text

from alembic import command
from app.events.model import event_of
from app.events.wire import EventCodec
from app.index import Index, make_engine
from app.index.eventlog import REMOVED, STORED
from app.index.migrate import alembic_config, upgrade_head
from tests.conftest import TEST_NS, key_for


async def _log_one(url: str) -> int:
    """Add an event-log row as a change's transaction does; its id."""
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO event_log (kind, key, size, digest) VALUES (0, 'k', 1, 'd')"))
            return int((await conn.execute(text("SELECT max(id) FROM event_log"))).scalar_one())
    finally:
        await engine.dispose()


async def _trim(url: str) -> None:
    """The publisher's trim: every row it has published goes."""
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("DELETE FROM event_log"))
    finally:
        await engine.dispose()


async def test_event_ids_never_repeat_across_a_downgrade_and_upgrade(index_url: str) -> None:
    """The publisher stands at the last id it published (``event_state.last_id``) and reads the rows above it: an
    id handed out again after a trim would be below it, and that change would never get an event. 0007's
    downgrade on SQLite rebuilt ``event_log`` without AUTOINCREMENT: after 0007 -> 0006 -> 0007 and a trim of
    every row, ids restarted at 1."""
    await upgrade_head(index_url)
    cfg = alembic_config(index_url)
    ids = [await _log_one(index_url) for _ in range(3)]
    await _trim(index_url)
    await asyncio.to_thread(command.downgrade, cfg, "0006")
    ids.append(await _log_one(index_url))  # at 0006
    await _trim(index_url)
    await upgrade_head(index_url)
    ids.append(await _log_one(index_url))
    await _trim(index_url)
    await asyncio.to_thread(command.downgrade, cfg, "0006")
    await upgrade_head(index_url)
    ids.append(await _log_one(index_url))
    assert ids == sorted(set(ids)), ids


# rows as revisions 0006 to 0008 wrote them: (kind, key, size, digest, tokens, parent, waits_for, token)
PARENT = "ab" * 16
OLD_ROWS = [
    (0, key_for(1), 10, "d1", "1,2,3", None, None, 7),  # the first block of a prefix: token ids, no parent
    (0, key_for(2), 20, "d2", "4,5", PARENT, "7", None),  # a child, waiting for its parent's PUT
    (0, key_for(3), 30, "d3", "", None, None, None),  # a meta that said nothing
    (0, key_for(4), 40, "d4", None, None, None, None),  # no meta sent
    (2, key_for(1), 0, "", None, None, None, 7),  # a release row
    (1, key_for(2), 20, "d2", None, None, None, None),  # a removal
]


def _expected(kind: str, i: int, size: int, digest: str | None, tokens: list[int] | None, parent: str | None) -> Any:
    out: dict[str, Any] = {
        "type": "BlockStored" if kind == "stored" else "BlockRemoved",
        "key": key_for(i),
        "namespace": TEST_NS,
        "block_hash": hashlib.sha256(str(i).encode()).hexdigest(),
        "group": 0,
        "rank": 0,
        "size": size,
    }
    if kind == "stored":
        out["digest"] = digest
    if tokens is not None:
        out["token_ids"] = tokens
        out["parent_block_hash"] = parent
    return out


async def _old_columns(url: str) -> list[tuple[Any, ...]]:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            q = "SELECT kind, key, size, digest, tokens, parent, waits_for, token FROM event_log ORDER BY id"
            return [tuple(r) for r in (await conn.execute(text(q))).all()]
    finally:
        await engine.dispose()


async def test_0009_folds_the_block_meta_columns_and_the_log_replays_the_same_events(index_url: str) -> None:
    """A log written at 0008 (a column per block-meta field) upgrades in place: each row's meta becomes the one
    value, and the publisher's reader makes of it the same events (JSON and vLLM's bytes) the rows said; the ids
    go on after the last one handed out; down to 0008 gives the columns back as they were."""
    cfg = alembic_config(index_url)
    await asyncio.to_thread(command.upgrade, cfg, "0008")
    engine = make_engine(index_url)
    try:
        async with engine.begin() as conn:
            for row in OLD_ROWS:
                await conn.execute(
                    text(
                        "INSERT INTO event_log (kind, key, size, digest, tokens, parent, waits_for, token) "
                        "VALUES (:kind, :key, :size, :digest, :tokens, :parent, :waits_for, :token)"
                    ),
                    dict(
                        zip(
                            ("kind", "key", "size", "digest", "tokens", "parent", "waits_for", "token"),
                            row,
                            strict=True,
                        )
                    ),
                )
    finally:
        await engine.dispose()
    await upgrade_head(index_url)

    index = Index(make_engine(index_url), flush_interval_s=3600, events=True)
    await index.start()
    try:
        rows = await index.event_log.rows(after=0, upto=1 << 62, limit=100)
        assert [(r.kind, r.key, r.meta, r.waits_for, r.token) for r in rows] == [
            (0, key_for(1), "tokens=1,2,3", (), 7),
            (0, key_for(2), f"parent={PARENT}; tokens=4,5", (7,), None),
            (0, key_for(3), "", (), None),
            (0, key_for(4), None, (), None),
            (2, key_for(1), None, (), 7),
            (1, key_for(2), None, (), None),
        ]
        codec = EventCodec()
        events = [event_of(r, codec) for r in rows if r.kind in (STORED, REMOVED)]
        assert [e.as_json() for e in events] == [
            _expected("stored", 1, 10, "d1", [1, 2, 3], None),
            _expected("stored", 2, 20, "d2", [4, 5], PARENT),
            _expected("stored", 3, 30, "d3", [], None),
            _expected("stored", 4, 40, "d4", None, None),
            _expected("removed", 2, 20, None, None, None),
        ]
        h = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(5)]
        assert [e.wire for e in events] == [
            codec.encode(kind="stored", block_hash=h[1], group=0, token_ids=(1, 2, 3), parent=None),
            codec.encode(kind="stored", block_hash=h[2], group=0, token_ids=(4, 5), parent=PARENT),
            codec.encode(kind="stored", block_hash=h[3], group=0, token_ids=(), parent=None),
            codec.encode(kind="stored", block_hash=h[4], group=0, token_ids=(), parent=None),
            codec.encode(kind="removed", block_hash=h[2], group=0, token_ids=(), parent=None),
        ]
        await index.event_log.release(key_for(9), token=1)  # a row after the migration: the next id
        assert [r.id for r in await index.event_log.rows(after=rows[-1].id, upto=1 << 62, limit=10)] == [
            rows[-1].id + 1
        ]
    finally:
        await index.close()

    await asyncio.to_thread(command.downgrade, cfg, "0008")
    assert (await _old_columns(index_url))[: len(OLD_ROWS)] == OLD_ROWS
