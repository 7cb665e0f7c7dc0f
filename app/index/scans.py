"""Whole-table reads of the index: usage, incomplete uploads, reconcile, eviction, namespaces."""

from __future__ import annotations

from sqlalchemy import Connection, case, func, select

from app.index.engine import guard
from app.index.models import Block, Namespace, Part, Usage
from app.index.records import BlockRecord, NamespaceUsage, Upload, block_record
from app.index.writer import GroupCommit


class Scans:
    """The index's whole-table reads and bulk writes, through its group commit."""

    def __init__(self, commits: GroupCommit) -> None:
        self._commits = commits

    async def usage(self) -> tuple[int, int]:
        """(blocks, bytes) recorded in the index."""

        async def q() -> tuple[int, int]:
            async with self._commits.engine.connect() as conn:
                row = (await conn.execute(select(func.count(), func.coalesce(func.sum(Block.size), 0)))).one()
            return int(row[0]), int(row[1])

        return await guard(q(), "read")

    async def usage_by_namespace(self) -> dict[str, tuple[int, int]]:
        """``namespace -> (blocks, bytes)`` from the usage table: block rows plus stored parts of incomplete
        objects, exact as of the last commit of any process (triggers move it in every change's transaction)."""

        stmt = select(Usage.namespace, func.sum(Usage.blocks), func.sum(Usage.bytes)).group_by(Usage.namespace)

        def q(conn: Connection) -> dict[str, tuple[int, int]]:
            return {r[0]: (int(r[1]), int(r[2])) for r in conn.execute(stmt) if r[1] or r[2]}

        # through the group commit, in its order: this process's changes committed before the read are in it and
        # have moved the caller's view (each moves it as its commit returns, before the read's caller resumes),
        # those after are not; a read beside the writer could count a change its view then moved by again. One hop
        # to the writer thread on SQLite (through the async engine each statement was several round trips)
        result: dict[str, tuple[int, int]] = await self._commits.write(q)
        return result

    async def uploads(self, *, namespace: str | None = None) -> list[Upload]:
        """Every incomplete multi-part object, with its newest part's time (its last activity)."""

        async def q() -> list[Upload]:
            stmt = select(
                Part.key, Part.namespace, func.max(Part.created_at), func.sum(Part.end - Part.start)
            ).group_by(Part.key, Part.namespace)
            if namespace is not None:
                stmt = stmt.where(Part.namespace == namespace)
            async with self._commits.engine.connect() as conn:
                return [
                    Upload(key=r[0], namespace=r[1] or "", last_part_at=float(r[2]), bytes=int(r[3]))
                    for r in await conn.execute(stmt)
                ]

        return await guard(q(), "read")

    # -- capacity, reconcile and admin ----------------------------------------------------------------------

    async def block_versions(self) -> dict[str, tuple[int, str | None]]:
        """Every block row's key -> (size, stamp) (reconcile compares them with the store's listing)."""

        async def q() -> dict[str, tuple[int, str | None]]:
            async with self._commits.engine.connect() as conn:
                rows = await conn.execute(select(Block.key, Block.size, Block.stamp))
                return {r.key: (int(r.size), r.stamp) for r in rows}

        return await guard(q(), "scan")

    async def lru_candidates(self, *, limit: int, namespace: str | None = None) -> list[BlockRecord]:
        """The rows of the ``limit`` least recently used blocks (last access, then creation time, then key)."""

        async def q() -> list[BlockRecord]:
            stmt = select(Block)
            if namespace is not None:
                stmt = stmt.where(Block.namespace == namespace)
            stmt = stmt.order_by(Block.last_access, Block.created_at, Block.key).limit(limit)
            async with self._commits.engine.connect() as conn:
                return [block_record(r) for r in await conn.execute(stmt)]

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
            async with self._commits.engine.connect() as conn:
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
            async with self._commits.engine.connect() as conn:
                return [r[0] for r in await conn.execute(select(Namespace.name).order_by(Namespace.name))]

        return await guard(q(), "read")

    async def namespace_blocks(self, namespace: str) -> list[tuple[str, int]]:
        """(key, size) of every block row of ``namespace``."""

        async def q() -> list[tuple[str, int]]:
            stmt = select(Block.key, Block.size).where(Block.namespace == namespace)
            async with self._commits.engine.connect() as conn:
                return [(r.key, int(r.size)) for r in await conn.execute(stmt)]

        return await guard(q(), "read")
