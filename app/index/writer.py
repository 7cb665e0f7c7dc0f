"""The index's one writer: a group-commit task. Concurrent writes share a transaction, and each caller returns only
after the transaction holding its change has committed; a failing change is retried alone, so the rest commit.

On SQLite the transaction runs whole on the writer thread through the blocking twin engine (one hop off the event
loop, not one per statement); hot point reads run on reader threads the same way (``_read``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from sqlalchemy import Connection, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from app.errors import IndexUnavailable
from app.index.engine import WRITE_OPTION, blocking_twin, guard

SyncOp = Callable[[Connection], Any]
T = TypeVar("T")
READER_THREADS = 4
EXCLUSIVE = {"evict": 0x6B76_6761_7465_01, "events": 0x6B76_6761_7465_02}
"""PostgreSQL advisory lock keys of the named exclusive sections (``GroupCommit.exclusive``)."""


class GroupCommit:
    def __init__(self, engine: AsyncEngine, *, max_batch: int = 512) -> None:
        self.engine = engine
        self._dialect = engine.dialect.name
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[SyncOp, asyncio.Future[Any]]] = asyncio.Queue()
        self._twin = blocking_twin(engine)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvgate-index-writer")
        self._held: Connection | None = None
        """The writer thread's connection (SQLite), used only on that thread."""
        self._readers = concurrent.futures.ThreadPoolExecutor(READER_THREADS, thread_name_prefix="kvgate-index-read")

    def close_threads(self) -> None:
        """Let the writer and reader threads end, and close the blocking engine's connections."""
        with contextlib.suppress(RuntimeError):  # already shut down
            self._writer.submit(self._release).result()
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        if self._twin is not None:
            self._twin.dispose()

    async def _read(self, fn: Callable[[Connection], T], what: str = "read") -> T:
        """``fn(conn)`` in one read transaction: on a reader thread (SQLite), or through the async engine."""
        twin = self._twin
        if twin is None:

            async def q() -> T:
                async with self.engine.connect() as conn:
                    return await conn.run_sync(fn)

            return await guard(q(), what)

        def blocking() -> T:
            with twin.connect() as conn:
                return fn(conn)

        return await guard(asyncio.get_running_loop().run_in_executor(self._readers, blocking), what)

    async def _write(self, op: SyncOp) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((op, fut))
        return await fut

    async def _commit_loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._commit(batch)

    async def _commit(self, batch: list[tuple[SyncOp, asyncio.Future[Any]]]) -> None:
        def run_all(conn: Connection) -> list[Any]:
            return [op(conn) for op, _ in batch]

        try:
            if self._twin is not None:
                results = await asyncio.get_running_loop().run_in_executor(self._writer, self._blocking, run_all)
            else:
                async with self.engine.connect() as conn:
                    await conn.execution_options(**{WRITE_OPTION: True})
                    async with conn.begin():
                        results = await conn.run_sync(run_all)
        except Exception as exc:
            if len(batch) > 1:  # isolate the failing op: the rest still commit
                for item in batch:
                    await self._commit([item])
                return
            err = IndexUnavailable(f"index write failed: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            _, fut = batch[0]
            if not fut.done():
                fut.set_exception(err)
            return
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    def _blocking(self, run_all: Callable[[Connection], list[Any]]) -> list[Any]:
        """One transaction on the writer thread's own connection, kept from one transaction to the next: a pool
        checkout and return per transaction cost about as much CPU as the SQL of a few rows. A transaction that
        fails closes it (the next one opens another), so a connection in an unknown state is never reused."""
        conn = self._held
        if conn is None:
            assert self._twin is not None
            conn = self._held = self._twin.connect().execution_options(**{WRITE_OPTION: True})
        try:
            with conn.begin():
                return run_all(conn)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        """Close the writer thread's connection (back to the pool), if it holds one."""
        conn, self._held = self._held, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    @contextlib.asynccontextmanager
    async def exclusive(self, name: str, *, poll_s: float = 0.05) -> AsyncIterator[None]:
        """A section one process at a time runs across every gateway sharing this index: on PostgreSQL an advisory
        lock held on a connection of its own for the section's length (polled every ``poll_s``, so a caller can
        time out); on SQLite nothing (its processes share a machine, where the coordination file serves)."""
        if self._dialect != "postgresql":
            yield
            return
        key = EXCLUSIVE[name]

        async def take(conn: Any) -> None:
            # polled (no event tells of another session's unlock), so that the caller's timeout can end the wait
            while not (await conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key})).scalar():  # noqa: ASYNC110
                await asyncio.sleep(poll_s)

        async with self.engine.connect() as conn:
            await guard(take(conn), "lock")
            try:
                yield
            finally:
                with contextlib.suppress(Exception):  # a dropped connection releases it all the same
                    await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})

    def _insert(self, table: Any) -> Any:
        """An INSERT of the index's dialect (both have ON CONFLICT, which the portable insert lacks)."""
        return (postgresql.insert if self._dialect == "postgresql" else sqlite.insert)(table)
