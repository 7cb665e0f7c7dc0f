"""Migrations down and up again keep what the running code relies on, on both databases (a real SQLite file, a real
PostgreSQL server)."""

from __future__ import annotations

import asyncio

from sqlalchemy import text

from alembic import command
from app.index import make_engine
from app.index.migrate import alembic_config, upgrade_head


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
