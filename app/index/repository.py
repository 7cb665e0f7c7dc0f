"""The index: block rows (size, digest, namespace, times, hits) and namespace fields.

Writes go through one group-commit task: concurrent PUTs share a transaction, and each caller returns only after
the transaction holding its row has committed. Access times and hit counts are written behind, in batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, bindparam, delete, event, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from app.errors import IndexUnavailable
from app.index.models import Block, Namespace, Part

log = logging.getLogger("kvgate.index")
T = TypeVar("T")
SyncOp = Callable[[Connection], Any]


@dataclass(frozen=True, slots=True)
class BlockRecord:
    key: str
    namespace: str
    rank: int
    group: int
    size: int
    digest: str
    created_at: float
    last_access: float
    hits: int


@dataclass(frozen=True, slots=True)
class PartRecord:
    """A stored byte range ``[start, end)`` of the object ``key`` of ``total`` bytes."""

    key: str
    start: int
    end: int
    total: int
    digest: str
    store_key: str


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    name: str
    fields: dict[str, Any]
    created_at: float


def _record(row: Any) -> BlockRecord:
    return BlockRecord(
        key=row.key,
        namespace=row.namespace,
        rank=row.rank,
        group=row.grp,
        size=row.size,
        digest=row.digest,
        created_at=row.created_at,
        last_access=row.last_access,
        hits=row.hits,
    )


def make_engine(url: str, *, sqlite_synchronous: str = "FULL") -> AsyncEngine:
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={sqlite_synchronous}")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_async_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True)


async def _guard(coro: Awaitable[T], what: str) -> T:
    try:
        return await coro
    except (SQLAlchemyError, DBAPIError, OSError, ConnectionError) as exc:
        raise IndexUnavailable(f"index {what} failed: {type(exc).__name__}") from exc


class Index:
    def __init__(self, engine: AsyncEngine, *, flush_interval_s: float = 1.0, max_batch: int = 512) -> None:
        self.engine = engine
        self._dialect = engine.dialect.name
        self._flush_interval = flush_interval_s
        self._max_batch = max_batch
        self._queue: asyncio.Queue[tuple[SyncOp, asyncio.Future[Any]]] = asyncio.Queue()
        self._access: dict[str, tuple[float, int]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._commit_loop(), name="kvgate-index-commit"),
            asyncio.create_task(self._access_loop(), name="kvgate-index-access"),
        ]

    async def close(self) -> None:
        with contextlib.suppress(IndexUnavailable):
            await self.flush_access()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.engine.dispose()

    async def check(self) -> None:
        async def probe() -> None:
            async with self.engine.connect() as conn:
                await conn.execute(select(func.count()).select_from(Namespace.__table__))

        await _guard(probe(), "check")

    # -- group commit ----------------------------------------------------------------------------------------

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
            async with self.engine.begin() as conn:
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

    # -- blocks ----------------------------------------------------------------------------------------------

    def _upsert_stmt(self, values: dict[str, Any]) -> Any:
        ins = (postgresql.insert if self._dialect == "postgresql" else sqlite.insert)(Block).values(**values)
        return ins.on_conflict_do_update(
            index_elements=[Block.key],
            set_={
                "size": ins.excluded.size,
                "digest": ins.excluded.digest,
                "created_at": ins.excluded.created_at,
                "last_access": ins.excluded.last_access,
            },
        )

    async def upsert_block(self, *, key: str, namespace: str, rank: int, group: int, size: int, digest: str) -> None:
        """Record a stored block; returns once the row is committed."""
        now = time.time()
        stmt = self._upsert_stmt(
            {
                "key": key,
                "namespace": namespace,
                "rank": rank,
                "grp": group,
                "size": size,
                "digest": digest,
                "created_at": now,
                "last_access": now,
                "hits": 0,
            }
        )
        await self._write(lambda conn: conn.execute(stmt))

    async def adopt_blocks(self, records: Sequence[BlockRecord]) -> None:
        if not records:
            return

        def run(conn: Connection) -> None:
            for r in records:
                conn.execute(
                    self._upsert_stmt(
                        {
                            "key": r.key,
                            "namespace": r.namespace,
                            "rank": r.rank,
                            "grp": r.group,
                            "size": r.size,
                            "digest": r.digest,
                            "created_at": r.created_at,
                            "last_access": r.last_access,
                            "hits": r.hits,
                        }
                    )
                )

        await self._write(run)

    async def delete_blocks(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        if not keys:
            return 0

        def run(conn: Connection) -> int:
            total = 0
            for start in range(0, len(keys), 500):
                total += conn.execute(delete(Block).where(Block.key.in_(keys[start : start + 500]))).rowcount
            return total

        for key in keys:
            self._access.pop(key, None)
        return int(await self._write(run))

    async def get(self, key: str) -> BlockRecord | None:
        async def q() -> BlockRecord | None:
            async with self.engine.connect() as conn:
                row = (await conn.execute(select(Block).where(Block.key == key))).first()
            return None if row is None else _record(row)

        return await _guard(q(), "read")

    async def get_many(self, keys: Sequence[str]) -> dict[str, BlockRecord]:
        async def q() -> dict[str, BlockRecord]:
            found: dict[str, BlockRecord] = {}
            async with self.engine.connect() as conn:
                for start in range(0, len(keys), 500):
                    chunk = list(keys[start : start + 500])
                    for row in await conn.execute(select(Block).where(Block.key.in_(chunk))):
                        found[row.key] = _record(row)
            return found

        return await _guard(q(), "read")

    async def iter_keys(self, *, batch: int = 5000) -> list[BlockRecord]:
        async def q() -> list[BlockRecord]:
            async with self.engine.connect() as conn:
                return [_record(r) for r in await conn.execute(select(Block).order_by(Block.key))]

        return await _guard(q(), "scan")

    async def usage(self) -> tuple[int, int]:
        """(blocks, bytes) recorded in the index."""

        async def q() -> tuple[int, int]:
            async with self.engine.connect() as conn:
                row = (await conn.execute(select(func.count(), func.coalesce(func.sum(Block.size), 0)))).one()
            return int(row[0]), int(row[1])

        return await _guard(q(), "read")

    # -- access times, written behind ------------------------------------------------------------------------

    def touch(self, key: str) -> None:
        """Note a read of ``key``; flushed in the background (never on the request path)."""
        _, hits = self._access.get(key, (0.0, 0))
        self._access[key] = (time.time(), hits + 1)
        if len(self._access) >= 50_000 and self._queue.empty():
            asyncio.get_running_loop().create_task(self.flush_access())

    async def flush_access(self) -> None:
        if not self._access:
            return
        pending, self._access = self._access, {}
        params = [{"k": k, "t": t, "n": n} for k, (t, n) in pending.items()]
        stmt = (
            update(Block)
            .where(Block.key == bindparam("k"))
            .values(last_access=func.max(Block.last_access, bindparam("t")), hits=Block.hits + bindparam("n"))
        )
        if self._dialect == "postgresql":
            stmt = (
                update(Block)
                .where(Block.key == bindparam("k"))
                .values(last_access=func.greatest(Block.last_access, bindparam("t")), hits=Block.hits + bindparam("n"))
            )
        await self._write(lambda conn: conn.execute(stmt.execution_options(synchronize_session=False), params))

    async def _access_loop(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval)
            try:
                await self.flush_access()
            except IndexUnavailable as exc:
                log.warning("access-time flush failed: %s", exc)

    # -- namespaces ------------------------------------------------------------------------------------------

    async def put_namespace(self, *, name: str, fields: dict[str, Any]) -> bool:
        """Record a namespace's fields; True if it was new."""
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))

        def run(conn: Connection) -> bool:
            ins = (postgresql.insert if self._dialect == "postgresql" else sqlite.insert)(Namespace).values(
                name=name, fields=text, created_at=time.time()
            )
            return bool(conn.execute(ins.on_conflict_do_nothing(index_elements=[Namespace.name])).rowcount)

        return bool(await self._write(run))

    async def get_namespace(self, name: str) -> NamespaceRecord | None:
        async def q() -> NamespaceRecord | None:
            async with self.engine.connect() as conn:
                row = (await conn.execute(select(Namespace).where(Namespace.name == name))).first()
            if row is None:
                return None
            return NamespaceRecord(name=row.name, fields=json.loads(row.fields), created_at=row.created_at)

        return await _guard(q(), "read")

    async def run_read(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """Run a read query built elsewhere (admin views) with the index's error translation."""

        async def q() -> T:
            async with self.engine.connect() as conn:
                return await fn(conn)

        return await _guard(q(), "read")

    # -- parts of multi-part objects -------------------------------------------------------------------------

    async def add_part(self, part: PartRecord) -> bool:
        """Record a part, create-only on (key, start); False if a part already starts there."""

        def run(conn: Connection) -> bool:
            ins = (postgresql.insert if self._dialect == "postgresql" else sqlite.insert)(Part).values(
                key=part.key,
                start=part.start,
                end=part.end,
                total=part.total,
                digest=part.digest,
                store_key=part.store_key,
                created_at=time.time(),
            )
            return bool(conn.execute(ins.on_conflict_do_nothing(index_elements=[Part.key, Part.start])).rowcount)

        return bool(await self._write(run))

    async def get_parts(self, key: str) -> list[PartRecord]:
        """The parts of ``key``, ordered by start."""

        async def q() -> list[PartRecord]:
            async with self.engine.connect() as conn:
                rows = await conn.execute(select(Part).where(Part.key == key).order_by(Part.start))
                return [
                    PartRecord(
                        key=r.key, start=r.start, end=r.end, total=r.total, digest=r.digest, store_key=r.store_key
                    )
                    for r in rows
                ]

        return await _guard(q(), "read")

    async def delete_parts(self, key: str) -> int:
        def run(conn: Connection) -> int:
            return int(conn.execute(delete(Part).where(Part.key == key)).rowcount)

        return int(await self._write(run))
