"""Whole-table reads and bulk writes of the index: usage, incomplete uploads, reconcile, eviction, namespaces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, case, delete, func, select, update

from app.index.engine import guard
from app.index.models import Block, Namespace, Part
from app.index.records import BlockRecord, Candidate, NamespaceUsage, row_values
from app.index.writer import GroupCommit, SyncOp


class Scans(GroupCommit):
    async def usage(self) -> tuple[int, int]:
        """(blocks, bytes) recorded in the index."""

        async def q() -> tuple[int, int]:
            async with self.engine.connect() as conn:
                row = (await conn.execute(select(func.count(), func.coalesce(func.sum(Block.size), 0)))).one()
            return int(row[0]), int(row[1])

        return await guard(q(), "read")

    async def part_bytes(self) -> dict[str, int]:
        """Bytes of stored parts of incomplete objects, by object key (capacity counts them)."""

        async def q() -> dict[str, int]:
            stmt = select(Part.key, func.sum(Part.end - Part.start)).group_by(Part.key)
            async with self.engine.connect() as conn:
                return {r[0]: int(r[1]) for r in await conn.execute(stmt)}

        return await guard(q(), "read")

    async def parts_summary(self) -> dict[str, tuple[float, list[str]]]:
        """Every incomplete object: key -> (oldest part's created_at, its parts' store keys)."""

        async def q() -> dict[str, tuple[float, list[str]]]:
            found: dict[str, tuple[float, list[str]]] = {}
            async with self.engine.connect() as conn:
                for r in await conn.execute(select(Part.key, Part.created_at, Part.store_key)):
                    oldest, keys = found.get(r.key, (r.created_at, []))
                    keys.append(r.store_key)
                    found[r.key] = (min(oldest, r.created_at), keys)
            return found

        return await guard(q(), "read")

    # -- capacity, reconcile and admin ----------------------------------------------------------------------

    async def block_versions(self) -> dict[str, tuple[int, str | None]]:
        """Every block row's key -> (size, stamp) (reconcile compares them with the store's listing)."""

        async def q() -> dict[str, tuple[int, str | None]]:
            async with self.engine.connect() as conn:
                rows = await conn.execute(select(Block.key, Block.size, Block.stamp))
                return {r.key: (int(r.size), r.stamp) for r in rows}

        return await guard(q(), "scan")

    async def adopt_many(self, records: Sequence[BlockRecord], *, chunk: int = 2000) -> None:
        """Upsert many rows at once (executemany, one transaction per chunk); used by reconcile."""
        ins = self._insert(Block)
        stmt = ins.on_conflict_do_update(
            index_elements=[Block.key],
            set_={
                "size": ins.excluded.size,
                "digest": ins.excluded.digest,
                "stamp": ins.excluded.stamp,
                "created_at": ins.excluded.created_at,
            },
        )
        rows = [row_values(r) for r in records]

        def run(part: list[dict[str, Any]]) -> SyncOp:
            return lambda conn: conn.execute(stmt, part)

        for start in range(0, len(rows), chunk):
            await self._write(run(rows[start : start + chunk]))

    async def set_stamps(self, stamps: dict[str, str]) -> None:
        """Record the stamp of rows written before stamps were (they were trusted on size, as they are now)."""
        if not stamps:
            return
        stmt = update(Block).where(Block.key == bindparam("k"), Block.stamp.is_(None)).values(stamp=bindparam("s"))
        params = [{"k": k, "s": s} for k, s in stamps.items()]
        await self._write(lambda conn: conn.execute(stmt.execution_options(synchronize_session=False), params))

    async def lru_candidates(self, *, limit: int, namespace: str | None = None) -> list[Candidate]:
        """The ``limit`` least recently used blocks (last access, then creation time, then key)."""

        async def q() -> list[Candidate]:
            stmt = select(Block.key, Block.namespace, Block.size, Block.created_at, Block.stamp)
            if namespace is not None:
                stmt = stmt.where(Block.namespace == namespace)
            stmt = stmt.order_by(Block.last_access, Block.created_at, Block.key).limit(limit)
            async with self.engine.connect() as conn:
                return [
                    Candidate(
                        key=r.key,
                        namespace=r.namespace,
                        size=int(r.size),
                        created_at=float(r.created_at),
                        stamp=r.stamp,
                    )
                    for r in await conn.execute(stmt)
                ]

        return await guard(q(), "read")

    async def namespace_usage(self, namespace: str | None = None) -> list[NamespaceUsage]:
        """Per-namespace aggregates of the block rows (one GROUP BY), ordered by name."""

        async def q() -> list[NamespaceUsage]:
            stmt = select(
                Block.namespace,
                func.count(),
                func.coalesce(func.sum(Block.size), 0),
                func.coalesce(func.sum(Block.hits), 0),
                func.coalesce(func.sum(case((Block.hits == 0, 1), else_=0)), 0),
                func.max(Block.created_at),
                func.max(Block.last_access),
            ).group_by(Block.namespace)
            if namespace is not None:
                stmt = stmt.where(Block.namespace == namespace)
            async with self.engine.connect() as conn:
                rows = (await conn.execute(stmt.order_by(Block.namespace))).all()
            return [
                NamespaceUsage(
                    namespace=r[0],
                    blocks=int(r[1]),
                    bytes=int(r[2]),
                    hits=int(r[3]),
                    never_read=int(r[4]),
                    last_write=None if r[5] is None else float(r[5]),
                    last_access=None if r[6] is None else float(r[6]),
                )
                for r in rows
            ]

        return await guard(q(), "read")

    async def namespace_names(self) -> list[str]:
        """Names of the namespaces that have recorded fields."""

        async def q() -> list[str]:
            async with self.engine.connect() as conn:
                return [r[0] for r in await conn.execute(select(Namespace.name).order_by(Namespace.name))]

        return await guard(q(), "read")

    async def namespace_blocks(self, namespace: str) -> list[tuple[str, int]]:
        """(key, size) of every block row of ``namespace``."""

        async def q() -> list[tuple[str, int]]:
            stmt = select(Block.key, Block.size).where(Block.namespace == namespace)
            async with self.engine.connect() as conn:
                return [(r.key, int(r.size)) for r in await conn.execute(stmt)]

        return await guard(q(), "read")

    async def delete_namespace(self, name: str) -> bool:
        """Remove a namespace's fields row; False if it had none."""

        def run(conn: Connection) -> bool:
            return bool(conn.execute(delete(Namespace).where(Namespace.name == name)).rowcount)

        return bool(await self._write(run))
