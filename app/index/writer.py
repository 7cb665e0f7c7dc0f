"""The index's one writer: a group-commit task. Concurrent writes share a transaction, and each caller returns only
after the transaction holding its change has committed; a failing change is retried alone, so the rest commit. A
transaction whose COMMIT itself fails (the connection dropped with it, its reply lost) may have committed: it is
never run again, and each of its callers gets ``CommitUnknown`` with what its statements returned, to read its row
back under its key and decide from that (app/core/versions.py).

On SQLite a transaction of point writes (a block's swap or removal: a few statements on indexed pages, each some
microseconds) runs its statements on the event loop and hands only its COMMIT, which writes and syncs the WAL, to a
thread of its own. A thread that runs SQL takes the GIL back after every statement, and each take while the loop
runs Python is a futex wait and a context switch on both threads: with the whole transaction on the writer thread
a small PUT spent much of its CPU in futex calls and the interpreter, with the COMMIT alone there about half the
futex time and none of the rest (``python -m benchmarks.gateway.cost --ops put --sizes 65536``; figures:
docs/benchmarks.md). The loop's BEGIN IMMEDIATE does not wait: when another process holds the write lock (a second
worker, ``kvgate gc``), the batch runs whole on the writer thread, which waits for it. Other writes (access times,
scans, the event log's upkeep: many rows) run whole on the writer thread through the blocking twin engine, one hop
off the loop; hot point reads run on reader threads the same way (``_read``).
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

from app.errors import CommitUnknown, IndexUnavailable
from app.index.engine import WRITE_OPTION, blocking_twin, guard, is_busy
from app.threads import Threads

SyncOp = Callable[[Connection], Any]
T = TypeVar("T")
READER_THREADS = 4
INLINE_MAX = 64
"""At most this many point writes run their statements on the loop in one transaction; a longer batch (a burst past
this many changes at once) runs whole on the writer thread, so that the loop never holds its SQL for long."""
EXCLUSIVE = {"evict": 0x6B76_6761_7465_01, "events": 0x6B76_6761_7465_02}
"""PostgreSQL advisory lock keys of the named exclusive sections (``GroupCommit.exclusive``)."""


class _CommitFailed(Exception):
    """A transaction's statements ran (``results``) and its COMMIT failed: whether it committed is unknown."""

    def __init__(self, results: list[Any]) -> None:
        super().__init__("commit failed")
        self.results = results


class GroupCommit:
    def __init__(self, engine: AsyncEngine, *, max_batch: int = 512) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[SyncOp, asyncio.Future[Any], bool]] = asyncio.Queue()
        self._twin = blocking_twin(engine)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvgate-index-writer")
        self._held: Connection | None = None
        """The writer thread's connection (SQLite), used only on that thread."""
        self._loop_held: Connection | None = None
        """The loop's write connection (SQLite): its BEGIN does not wait for the lock; its COMMIT runs on
        ``_committer``, one transaction at a time."""
        self._committer = Threads(max_threads=1, name="kvgate-index-commit")
        self._readers = concurrent.futures.ThreadPoolExecutor(READER_THREADS, thread_name_prefix="kvgate-index-read")

    def close_threads(self) -> None:
        """Let the writer and reader threads end, and close the blocking engine's connections."""
        with contextlib.suppress(RuntimeError):  # already shut down
            self._writer.submit(self._release).result()
        self._drop_loop_held()
        self._committer.close()
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        if self._twin is not None:
            self._twin.dispose()

    async def read(self, fn: Callable[[Connection], T], what: str = "read") -> T:
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

    async def write(self, op: SyncOp, *, point: bool = False) -> Any:
        """``op(conn)`` in a group-committed transaction; ``point``: a few statements on indexed rows, which may
        run on the event loop (SQLite; see the module docstring)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((op, fut, point))
        return await fut

    async def _commit_loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._commit(batch)

    async def _commit(self, batch: list[tuple[SyncOp, asyncio.Future[Any], bool]]) -> None:
        def run_all(conn: Connection) -> list[Any]:
            return [op(conn) for op, _, _ in batch]

        try:
            results: list[Any] | None = None
            if self._twin is not None and len(batch) <= INLINE_MAX and all(point for _, _, point in batch):
                results = await self._on_loop(run_all)
            if results is None and self._twin is not None:
                results = await asyncio.get_running_loop().run_in_executor(self._writer, self._blocking, run_all)
            elif results is None:
                results = await self._async(run_all)
        except _CommitFailed as failed:  # outcome unknown: never run again, each caller reads its row back
            cause = failed.__cause__
            for (_, fut, _), result in zip(batch, failed.results, strict=True):
                unknown = CommitUnknown(f"index commit failed, outcome unknown: {type(cause).__name__}", result=result)
                unknown.__cause__ = cause
                if not fut.done():
                    fut.set_exception(unknown)
            return
        except Exception as exc:
            if len(batch) > 1:  # isolate the failing op: the rest still commit
                for item in batch:
                    await self._commit([item])
                return
            err = IndexUnavailable(f"index write failed: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            _, fut, _ = batch[0]
            if not fut.done():
                fut.set_exception(err)
            return
        for (_, fut, _), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    async def _on_loop(self, run_all: Callable[[Connection], list[Any]]) -> list[Any] | None:
        """One transaction whose statements run here, on the loop, and whose COMMIT runs on ``_committer``; None
        when another connection holds the write lock (nothing was done: the caller runs it on the writer thread,
        which waits for the lock). A transaction that fails otherwise closes the connection, as ``_blocking``."""
        conn = self._loop_held
        if conn is None:
            assert self._twin is not None
            conn = self._twin.connect().execution_options(**{WRITE_OPTION: True})
            driver = conn.connection.dbapi_connection
            assert driver is not None
            driver.execute("PRAGMA busy_timeout=0")  # the driver's own: no transaction is begun for it
            self._loop_held = conn
        try:
            trans = conn.begin()  # BEGIN IMMEDIATE, not waiting for the lock
        except Exception as exc:
            if is_busy(exc):
                return None
            self._drop_loop_held()
            raise
        try:
            results = run_all(conn)
            driver = conn.connection.dbapi_connection
            assert driver is not None
        except BaseException as exc:
            if not (is_busy(exc) and self._rolled_back(trans)):
                self._drop_loop_held()
                raise
            return None  # a statement met another process's lock: rolled back, run it on the writer thread
        try:
            await self._committer.run(driver.commit)  # the WAL's write and sync, off the loop
        except BaseException as exc:
            if is_busy(exc) and self._rolled_back(trans):
                return None  # the COMMIT met another process's lock: nothing was written
            self._drop_loop_held()
            if not isinstance(exc, Exception):
                raise  # cancelled (shutdown): the callers are too
            raise _CommitFailed(results) from exc
        trans.commit()  # SQLAlchemy's account of it: the driver has no transaction left, its commit does nothing
        return results

    @staticmethod
    def _rolled_back(trans: Any) -> bool:
        try:
            trans.rollback()
        except Exception:
            return False
        return True

    def _drop_loop_held(self) -> None:
        """Close the loop's write connection for good (it does not wait for locks, unlike the pool's others)."""
        conn, self._loop_held = self._loop_held, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
            with contextlib.suppress(Exception):
                conn.close()

    def _blocking(self, run_all: Callable[[Connection], list[Any]]) -> list[Any]:
        """One transaction on the writer thread's own connection, kept from one transaction to the next: a pool
        checkout and return per transaction cost about as much CPU as the SQL of a few rows. A transaction that
        fails closes it (the next one opens another), so a connection in an unknown state is never reused."""
        conn = self._held
        if conn is None:
            assert self._twin is not None
            conn = self._held = self._twin.connect().execution_options(**{WRITE_OPTION: True})
        try:
            trans = conn.begin()
            try:
                results = run_all(conn)
            except BaseException:
                trans.rollback()
                raise
        except BaseException:
            self._release()
            raise
        try:
            trans.commit()
        except BaseException as exc:
            if is_busy(exc) and self._rolled_back(trans):
                self._release()
                raise  # SQLite's lock, not the COMMIT's outcome: nothing was written
            self._release()
            if not isinstance(exc, Exception):
                raise
            raise _CommitFailed(results) from exc
        return results

    async def _async(self, run_all: Callable[[Connection], list[Any]]) -> list[Any]:
        """One transaction through the async engine (PostgreSQL); a failed COMMIT is ``_CommitFailed``."""
        async with self.engine.connect() as conn:
            await conn.execution_options(**{WRITE_OPTION: True})
            trans = await conn.begin()
            try:
                results = await conn.run_sync(run_all)
            except BaseException:
                with contextlib.suppress(Exception):  # a dropped connection has rolled it back all the same
                    await trans.rollback()
                raise
            try:
                await trans.commit()
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await conn.invalidate()  # its state is unknown: never back to the pool
                raise _CommitFailed(results) from exc
            return results

    def _release(self) -> None:
        """Close the writer thread's connection (back to the pool), if it holds one."""
        conn, self._held = self._held, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    @contextlib.asynccontextmanager
    async def exclusive(self, name: str, *, poll_s: float = 0.05) -> AsyncIterator[None]:
        """A section one process at a time runs across every gateway sharing this index: on PostgreSQL an advisory
        lock of a transaction held open on a connection of its own for the section's length (polled every
        ``poll_s``, so a caller can time out); on SQLite nothing (its processes share a machine, where the
        coordination file serves). The lock is the transaction's, not the session's: it ends with the transaction
        however the section ends (rolled back; or, if the rollback fails or is cancelled, the connection is
        discarded, which ends it on the server), so a pooled connection never keeps it held."""
        if self.dialect != "postgresql":
            yield
            return
        key = EXCLUSIVE[name]

        async def take(conn: Any) -> None:
            # polled (no event tells of another session's unlock), so that the caller's timeout can end the wait
            lock = text("SELECT pg_try_advisory_xact_lock(:k)")
            while not (await conn.execute(lock, {"k": key})).scalar():  # noqa: ASYNC110
                await asyncio.sleep(poll_s)

        async with self.engine.connect() as conn:
            try:
                await guard(take(conn), "lock")
                yield
            finally:
                try:
                    await conn.rollback()
                except BaseException:
                    with contextlib.suppress(BaseException):
                        await conn.invalidate()  # its transaction's end unknown: never back to the pool
                    raise

    def dialect_insert(self, table: Any) -> Any:
        """An INSERT of the index's dialect (both have ON CONFLICT, which the portable insert lacks)."""
        return (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(table)
