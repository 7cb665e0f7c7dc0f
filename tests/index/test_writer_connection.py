"""The SQLite group commit keeps its writer thread's connection from one transaction to the next (a pool checkout
and return per transaction cost about as much CPU as the SQL of a few rows), and drops it when a transaction fails,
so that a connection in an unknown state is never reused."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
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


def _held(idx: Index) -> int:
    """How many connections the group commit holds now (its writer thread's, the loop's)."""
    return (idx._held is not None) + (idx._loop_held is not None)


def _half_written(conn: Connection) -> int:
    return int(conn.execute(text("SELECT count(*) FROM namespaces WHERE name = 'half'")).scalar_one())


@pytest.mark.parametrize("point", [False, True], ids=["writer-thread", "loop"])
async def test_a_failed_transaction_drops_the_connection_and_loses_no_other_write(
    sqlite_index: tuple[Index, list[str]], point: bool
) -> None:
    """A batch of point writes runs its statements on the loop (its COMMIT on a thread), any other batch whole on the
    writer thread: on either path a failing op's transaction drops its connection, and the other ops commit."""
    idx, pool_events = sqlite_index
    await put_row(idx, key=key(0), size=1, digest=f"{0:064x}")  # the loop's connection
    await idx.write(lambda conn: None)  # the writer thread's
    held_before = _held(idx)
    assert held_before == 2
    pool_events.clear()
    failed: list[Any] = []

    def broken(conn: Connection) -> Any:
        failed.append(conn.connection.dbapi_connection)
        conn.execute(text("INSERT INTO namespaces (name, fields, created_at) VALUES ('half', '{}', 1.0)"))
        raise RuntimeError("the op failed after writing")

    results = await asyncio.gather(
        idx.write(broken, point=point),
        *(put_row(idx, key=key(i), size=i, digest=f"{i:064x}") for i in range(1, 6)),
        return_exceptions=True,
    )
    assert isinstance(results[0], IndexUnavailable) and results[1:] == [None] * 5
    if point:  # the loop's connection does not wait for locks: it is closed, never handed to another user
        assert pool_events[0] == "checkin" and failed and all(_closed(c) for c in failed)
    else:  # back to the pool, rolled back
        assert pool_events[0] == "checkin"
    # every connection checked out was returned, but for those the group commit holds now
    assert held_before + pool_events.count("checkout") == pool_events.count("checkin") + _held(idx)
    await put_row(idx, key=key(9), size=9, digest=f"{9:064x}")  # the writer goes on with a fresh connection
    for i in (0, 1, 2, 3, 4, 5, 9):
        got = await idx.get(key(i))
        assert got is not None and got.size == (1 if i == 0 else i)
    assert await idx.read(_half_written) == 0  # the failed op's own statement was rolled back


def _closed(driver: Any) -> bool:
    try:
        driver.execute("SELECT 1")
    except Exception:
        return True
    return False


async def test_point_writes_run_their_statements_on_the_loop_and_commit_on_a_thread(
    sqlite_index: tuple[Index, list[str]],
) -> None:
    """A block's swap runs its SQL on the event loop's thread (a thread that runs SQL takes the GIL back after each
    statement: futex waits and context switches on both threads), and only its COMMIT (the WAL's write and sync)
    on another, so the loop never waits for a disk."""
    idx, _ = sqlite_index
    twin = blocking_twin(idx.engine)
    assert twin is not None
    seen: list[tuple[str, int]] = []

    def trace(driver: Any, _record: Any) -> None:
        driver.set_trace_callback(lambda sql: seen.append((sql.split()[0].upper(), threading.get_ident())))

    event.listen(twin, "connect", trace)
    loop_thread = threading.get_ident()
    await asyncio.gather(*(put_row(idx, key=key(i), size=i, digest=f"{i:064x}") for i in range(8)))
    by_kind: dict[str, set[int]] = {}
    for kind, thread in seen:
        by_kind.setdefault(kind, set()).add(thread)
    assert by_kind["BEGIN"] == {loop_thread} and by_kind["INSERT"] == {loop_thread}
    assert loop_thread not in by_kind["COMMIT"]
    for i in range(8):
        got = await idx.get(key(i))
        assert got is not None and got.size == i


async def test_a_write_waits_for_another_process_s_lock_and_commits(
    sqlite_index: tuple[Index, list[str]], tmp_path: Path
) -> None:
    """The loop's BEGIN does not wait for the write lock; when another process holds it (a second worker, ``kvgate
    gc``), the batch runs on the writer thread, which waits for it: the write is late, never refused."""
    idx, _ = sqlite_index
    await put_row(idx, key=key(9), size=9, digest=f"{9:064x}")  # WAL mode: a gateway's first connection sets it
    other = sqlite3.connect(tmp_path / "index.db", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        writes = asyncio.gather(*(put_row(idx, key=key(i), size=i, digest=f"{i:064x}") for i in range(4)))
        await asyncio.sleep(0.3)
        assert not writes.done()  # waiting for the lock
        other.execute("COMMIT")
        assert await writes == [None] * 4
    finally:
        other.close()
    for i in range(4):
        got = await idx.get(key(i))
        assert got is not None and got.size == i
