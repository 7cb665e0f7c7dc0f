"""The SQLite group commit keeps its writer thread's connection from one transaction to the next (a pool checkout
and return per transaction cost about as much CPU as the SQL of a few rows), and drops it when a transaction fails,
so that a connection in an unknown state is never reused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, event, text

from app.errors import IndexUnavailable
from app.index import Index, make_engine
from app.index.engine import blocking_twin
from app.index.migrate import upgrade_head
from tests.index.test_index_dialects import key, put_row


@pytest.fixture
async def sqlite_index(tmp_path: Path) -> AsyncIterator[tuple[Index, list[str]]]:
    """An index on a real SQLite file, and the pool events of its blocking engine ("checkout", "checkin")."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'index.db'}"
    await upgrade_head(url)
    engine = make_engine(url)
    twin = blocking_twin(engine)
    assert twin is not None
    pool_events: list[str] = []
    event.listen(twin, "checkout", lambda *_: pool_events.append("checkout"))
    event.listen(twin, "checkin", lambda *_: pool_events.append("checkin"))
    idx = Index(engine, flush_interval_s=3600)
    await idx.start()
    try:
        yield idx, pool_events
    finally:
        await idx.close()


async def test_the_writer_keeps_one_connection_across_transactions(sqlite_index: tuple[Index, list[str]]) -> None:
    idx, pool_events = sqlite_index
    pool_events.clear()
    for i in range(20):  # one at a time: 20 transactions
        await put_row(idx, key=key(i), size=i, digest=f"{i:064x}")
    assert pool_events == ["checkout"]
    for i in range(20):
        got = await idx.get(key(i))
        assert got is not None and got.size == i


async def test_a_failed_transaction_drops_the_connection_and_loses_no_other_write(
    sqlite_index: tuple[Index, list[str]],
) -> None:
    idx, pool_events = sqlite_index
    await put_row(idx, key=key(0), size=1, digest=f"{0:064x}")
    pool_events.clear()

    def broken(conn: Connection) -> Any:
        conn.execute(text("INSERT INTO namespaces (name, fields, created_at) VALUES ('half', '{}', 1.0)"))
        raise RuntimeError("the op failed after writing")

    results = await asyncio.gather(
        idx._write(broken),
        *(put_row(idx, key=key(i), size=i, digest=f"{i:064x}") for i in range(1, 6)),
        return_exceptions=True,
    )
    assert isinstance(results[0], IndexUnavailable) and results[1:] == [None] * 5
    # the failed transaction's connection went back to the pool first; each later one was checked out anew, and
    # all but the one the writer holds now went back
    assert pool_events[0] == "checkin" and pool_events.count("checkout") == pool_events.count("checkin")
    await put_row(idx, key=key(9), size=9, digest=f"{9:064x}")  # the writer goes on with a fresh connection
    for i in (0, 1, 2, 3, 4, 5, 9):
        got = await idx.get(key(i))
        assert got is not None and got.size == (1 if i == 0 else i)

    def half_written(conn: Connection) -> int:
        return int(conn.execute(text("SELECT count(*) FROM namespaces WHERE name = 'half'")).scalar_one())

    assert await idx._read(half_written) == 0  # the failed op's own statement was rolled back
