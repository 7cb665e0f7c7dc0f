"""The index's one writer: a group-commit task. Concurrent writes share a transaction, and each caller returns only
after the transaction holding its change has committed; a failing change is retried alone, so the rest commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from app.errors import IndexUnavailable
from app.index.engine import WRITE_OPTION

SyncOp = Callable[[Connection], Any]


class GroupCommit:
    def __init__(self, engine: AsyncEngine, *, max_batch: int = 512) -> None:
        self.engine = engine
        self._dialect = engine.dialect.name
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[SyncOp, asyncio.Future[Any]]] = asyncio.Queue()

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

    def _insert(self, table: Any) -> Any:
        """An INSERT of the index's dialect (both have ON CONFLICT, which the portable insert lacks)."""
        return (postgresql.insert if self._dialect == "postgresql" else sqlite.insert)(table)
