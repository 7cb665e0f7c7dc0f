"""Engines (SQLite pragmas, PostgreSQL pool) and the translation of database failures into IndexUnavailable."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from sqlalchemy import event
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app.errors import IndexUnavailable

T = TypeVar("T")
WRITE_OPTION = "kvgate_write"
"""Execution option of the index's write connections (SQLite: BEGIN IMMEDIATE)."""


def make_engine(url: str, *, sqlite_synchronous: str = "FULL", busy_timeout_s: float = 30.0) -> AsyncEngine:
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": busy_timeout_s})

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={sqlite_synchronous}")
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()
            dbapi_conn.isolation_level = None  # transactions are begun below, not by the driver's guesswork

        @event.listens_for(engine.sync_engine, "begin")
        def _begin(conn: Any) -> None:
            # A write transaction reads the row it replaces (Index.swap_block): IMMEDIATE takes the write lock
            # before that read, so another process's writer cannot slip in between (the driver's default begins
            # only at the first INSERT, after the read).
            immediate = conn.get_execution_options().get(WRITE_OPTION)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine
    return create_async_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True)


async def guard(coro: Awaitable[T], what: str) -> T:
    try:
        return await coro
    except (SQLAlchemyError, DBAPIError, OSError, ConnectionError) as exc:
        raise IndexUnavailable(f"index {what} failed: {type(exc).__name__}") from exc
