"""Engines (SQLite pragmas, PostgreSQL pool) and the translation of database failures into IndexUnavailable.

On SQLite an engine comes with a blocking twin (``blocking_twin``): the same file through the stdlib driver, used
from worker threads to run a whole transaction or read in ONE hop off the event loop. Through aiosqlite each
statement, the BEGIN, the COMMIT and the pool checkout is its own round trip through the loop; with a loop busy
receiving bodies, a group commit of a few rows took most of a 2 MiB PUT's latency that way.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Awaitable
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app.errors import IndexUnavailable

T = TypeVar("T")
WRITE_OPTION = "kvgate_write"
"""Execution option of the index's write connections (SQLite: BEGIN IMMEDIATE)."""


_TWIN = "kvgate_blocking_twin"
SQLITE_MMAP_BYTES = 1 << 30
"""SQLite reads pages through a memory map of the file up to this size (PRAGMA mmap_size): a lookup's probes then
read pages in place from the OS page cache, shared by all connections, where the default is a read() call and a copy
into each connection's own 2 MiB page cache per page missed (``python -m benchmarks.gateway.lookup_scale``)."""


def make_engine(
    url: str,
    *,
    sqlite_synchronous: str = "FULL",
    busy_timeout_s: float = 30.0,
    sqlite_mmap_bytes: int = SQLITE_MMAP_BYTES,
) -> AsyncEngine:
    if url.startswith("sqlite"):
        pragmas = functools.partial(
            _sqlite_events, synchronous=sqlite_synchronous, busy_timeout_s=busy_timeout_s, mmap_bytes=sqlite_mmap_bytes
        )
        engine = create_async_engine(url, connect_args={"timeout": busy_timeout_s})
        pragmas(engine.sync_engine)
        twin = create_engine(
            engine.url.set(drivername="sqlite"),
            connect_args={"timeout": busy_timeout_s, "check_same_thread": False},
            pool_size=8,
            max_overflow=0,
        )
        pragmas(twin)
        setattr(engine.sync_engine, _TWIN, twin)
        return engine
    return create_async_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True)


def blocking_twin(engine: AsyncEngine) -> Engine | None:
    """The blocking engine on the same SQLite file (None on PostgreSQL: asyncpg's pipeline is not the bottleneck)."""
    twin: Engine | None = getattr(engine.sync_engine, _TWIN, None)
    return twin


def _sqlite_events(engine: Engine, *, synchronous: str, busy_timeout_s: float, mmap_bytes: int) -> None:
    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cur.execute(f"PRAGMA mmap_size={int(mmap_bytes)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()
        dbapi_conn.isolation_level = None  # transactions are begun below, not by the driver's guesswork

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        # A write transaction reads the row it replaces (Index.swap_block): IMMEDIATE takes the write lock
        # before that read, so another process's writer cannot slip in between (the driver's default begins
        # only at the first INSERT, after the read).
        immediate = conn.get_execution_options().get(WRITE_OPTION)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


SQLITE_BUSY = 5


def is_busy(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's "database is locked" (another connection holds the lock; any extended code)."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    code = getattr(orig, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == SQLITE_BUSY


_NETWORK = (ConnectionError, TimeoutError, socket.gaierror)
"""A server refusing, resetting or not answering, or a name that does not resolve yet."""
_NOT_UP_YET = frozenset({"ConnectionDoesNotExistError", "CannotConnectNowError", "TooManyConnectionsError"})
"""asyncpg's errors of a server not reachable yet (a dropped connection, a server starting or full), which reach
a caller unwrapped on some paths (alembic's connect)."""


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached now (worth another try later), not that a setting, a
    credential or a statement is wrong (no try mends those)."""
    if isinstance(exc, DBAPIError):
        return exc.connection_invalidated or is_busy(exc) or (exc.orig is not None and unreachable(exc.orig))
    return isinstance(exc, (IndexUnavailable, *_NETWORK)) or type(exc).__name__ in _NOT_UP_YET


async def guard(coro: Awaitable[T], what: str) -> T:
    try:
        return await coro
    except (SQLAlchemyError, DBAPIError, OSError, ConnectionError) as exc:
        raise IndexUnavailable(f"index {what} failed: {type(exc).__name__}") from exc
