"""Staging intents: the fence between a writer committing a stored object and a sweep removing it.

On a store where each version is an object of its own (S3), and for the objects of parts, a written object that no
row names is either a write about to commit or one that never will (its writer died, or gave up). Telling them
apart by the object's age compares the store's clock (``LastModified``) with the sweeper's, two machines' clocks: a
sweeper whose clock ran ahead removed a live writer's object just before its row committed naming it (PUT 201,
then GET 404). So the index decides, by one clock, its own:

1. before writing the object the writer records an intent ``(key, stamp)``, ``staged_at`` the database's now;
2. the commit that names the object (``Index.swap_block`` for a version, ``Index.add_part`` for a part) deletes the
   intent in its own transaction, and writes nothing if it was gone (the sweep took it);
3. a sweep deletes an intent only if it is older than its cutoff by the database's clock (or there is none: the
   object's commit took it, and no row names the object now), in a transaction that also sees the rows, and
   removes the object only then.

The intent is deleted by exactly one of the two transactions (a row lock on PostgreSQL, one writer on SQLite), so
a swept object is never committed and a committed one never swept, whatever the machines' clocks say.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import Connection, delete, exists, literal_column, select

from app.errors import CommitUnknown, IndexUnavailable
from app.index.models import Block, Part, StagingIntent
from app.index.writer import GroupCommit

PART = ""
"""The stamp of a part object's intent (its store key is unique already)."""


class Fenced(enum.Enum):
    FENCED = "fenced"


FENCED: Final = Fenced.FENCED
"""A commit found its staging intent gone (a sweep took it): nothing was written."""


class Staging:
    """The staging intents (see the module doc), through the index's group commit."""

    def __init__(self, commits: GroupCommit) -> None:
        self._commits = commits

    def db_now_sql(self) -> Any:
        """The database's clock, in seconds since the epoch, as a SQL expression."""
        if self._commits.dialect == "postgresql":
            return literal_column("CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)")
        return literal_column("((julianday('now') - 2440587.5) * 86400.0)")

    async def db_now(self) -> float:
        """The database's clock now (seconds since the epoch): the one clock that sweeps compare ages with."""
        now: float = await self._commits.read(lambda conn: float(conn.execute(select(self.db_now_sql())).scalar_one()))
        return now

    async def add_intent(self, *, key: str, stamp: str = PART) -> None:
        """Record that an object ``(key, stamp)`` is about to be written (step 1 of the module docstring). A COMMIT
        whose outcome is unknown is settled by reading the intent back: it is this writer's alone (its stamp or store
        key is new) and only a sweep of old intents removes one, so found means recorded; not found (or not yet
        committed) means the writer gives up before writing anything (IndexUnavailable), and an intent committed
        after all is swept once old, with no object to remove."""
        values = {"key": key, "stamp": stamp, "staged_at": self.db_now_sql()}
        try:
            await self._commits.write(
                lambda conn: conn.execute(self._commits.dialect_insert(StagingIntent).values(**values)), point=True
            )
        except CommitUnknown as exc:
            if not await self._has_intent(key=key, stamp=stamp):  # IndexUnavailable if that cannot be read either
                raise IndexUnavailable(f"{key!r}: the staging intent's commit failed and it is not there") from exc

    async def _has_intent(self, *, key: str, stamp: str) -> bool:
        stmt = select(exists().where(StagingIntent.key == key, StagingIntent.stamp == stamp))
        found: bool = await self._commits.read(lambda conn: bool(conn.execute(stmt).scalar_one()))
        return found

    async def drop_intent(self, *, key: str, stamp: str = PART) -> None:
        """Forget an intent whose object was discarded (nothing will commit it)."""
        stmt = delete(StagingIntent).where(StagingIntent.key == key, StagingIntent.stamp == stamp)
        await self._commits.write(lambda conn: conn.execute(stmt), point=True)

    @staticmethod
    def take_intent(conn: Connection, key: str, stamp: str) -> bool:
        """Delete intent ``(key, stamp)`` inside a commit's transaction; False if it was gone (swept)."""
        stmt = delete(StagingIntent).where(StagingIntent.key == key, StagingIntent.stamp == stamp)
        return bool(conn.execute(stmt).rowcount)

    def _claim(self, conn: Connection, key: str, stamp: str, older_than_s: float, named: Any) -> bool:
        """In this order, so that each read sees what a concurrent commit did (PostgreSQL: a statement that waited
        for a row lock sees the rows committed meanwhile): take an old intent (then the object is ours: no commit
        can take it now); else keep the object if an intent is there (young) or a row names it."""
        old = delete(StagingIntent).where(
            StagingIntent.key == key,
            StagingIntent.stamp == stamp,
            StagingIntent.staged_at <= self.db_now_sql() - older_than_s,
        )
        if conn.execute(old).rowcount:
            return True
        young = exists().where(StagingIntent.key == key, StagingIntent.stamp == stamp)
        return not conn.execute(select(young)).scalar() and not conn.execute(select(named)).scalar()

    async def claim_version(self, *, key: str, stamp: str, older_than_s: float) -> bool:
        """May version ``stamp`` of ``key`` be removed? True if no row names it and it is not being staged (no
        intent younger than ``older_than_s`` by the database's clock; an old one is deleted): once this returns
        True, no commit can name it."""
        named = exists().where(Block.key == key, Block.stamp == stamp)
        claimed: bool = await self._commits.write(
            lambda conn: self._claim(conn, key, stamp, older_than_s, named), point=True
        )
        return claimed

    async def claim_part_object(self, *, store_key: str, older_than_s: float) -> bool:
        """May the part object ``store_key`` be removed? As ``claim_version``, for a part's row."""
        named = exists().where(Part.store_key == store_key)
        claimed: bool = await self._commits.write(lambda conn: self._claim(conn, store_key, PART, older_than_s, named))
        return claimed

    async def expired_intents(self, *, older_than_s: float) -> Sequence[tuple[str, str]]:
        """Intents older than ``older_than_s`` by the database's clock: objects whose writer is gone (or that it
        never wrote), for a sweep to claim and remove."""
        stmt = select(StagingIntent.key, StagingIntent.stamp).where(
            StagingIntent.staged_at <= self.db_now_sql() - older_than_s
        )
        return await self._commits.read(lambda conn: [(r[0], r[1]) for r in conn.execute(stmt)])
