"""Tables. Any change here comes with an alembic revision under alembic/versions."""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, Index, Integer, LargeBinary, MetaData, SmallInteger, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Block(Base):
    __tablename__ = "blocks"

    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    namespace: Mapped[str] = mapped_column(String(256), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    grp: Mapped[int] = mapped_column(BigInteger)
    size: Mapped[int] = mapped_column(BigInteger)
    digest: Mapped[str] = mapped_column(String(64))
    """The version's checksum token (contract.wire.Checksum.token): ``crc64nvme:<hex>``, or a sha256's bare hex
    (every row older than 0005 is one), so each row says its own algorithm."""
    created_at: Mapped[float] = mapped_column(Float)
    last_access: Mapped[float] = mapped_column(Float)
    hits: Mapped[int] = mapped_column(BigInteger, default=0)
    stamp: Mapped[str | None] = mapped_column(String(80), nullable=True)
    """The stored version this row describes (app.storage.base.Staged.stamp); NULL for rows older than 0003."""
    chunk_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The chunk size of ``chunk_sums``; NULL for rows older than 0005 (their ranges are checked whole)."""
    chunk_sums: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    """The CRC64NVME of each chunk of the version, 8 bytes each, big-endian (at most 128 of them)."""

    __table_args__ = (Index("ix_blocks_last_access", "last_access"),)


class Namespace(Base):
    __tablename__ = "namespaces"

    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    fields: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)


class Part(Base):
    """One byte range of a multi-part object that is not complete yet (see app/core/parts.py)."""

    __tablename__ = "parts"

    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    end: Mapped[int] = mapped_column(BigInteger)
    """Exclusive end of the range."""
    total: Mapped[int] = mapped_column(BigInteger)
    digest: Mapped[str] = mapped_column(String(64))
    """The part's checksum token, as ``Block.digest``."""
    store_key: Mapped[str] = mapped_column(String(640))
    created_at: Mapped[float] = mapped_column(Float)
    namespace: Mapped[str | None] = mapped_column(String(256), nullable=True)
    """The object's namespace (capacity counts stored parts per namespace); NULL only for rows older than 0004."""


class Usage(Base):
    """Stored bytes and blocks per namespace: block rows plus the parts of incomplete objects. Kept by triggers
    on ``blocks`` and ``parts`` (alembic revision 0004), so it moves in the same transaction as every change of a
    row, whoever makes it (any gateway, replica, ``kvgate gc`` or ``kvgate import``), and is exact at every commit.
    A namespace's figures are the sum over its slots (PostgreSQL spreads concurrent transactions over 16 slots so
    that replicas do not queue on one row; SQLite has one writer and uses slot 0).

    A batch migration (table rebuild) of ``blocks`` or ``parts`` on SQLite drops their triggers: it must create
    them again (``USAGE_TRIGGERS`` in 0004)."""

    __tablename__ = "usage"

    namespace: Mapped[str] = mapped_column(String(256), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True, default=0)
    blocks: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)


class EventLogRow(Base):
    """One committed change of a block, written in the change's own transaction (app/index/eventlog.py), while KV
    events are on: whoever commits it (a gateway, a replica, ``kvgate gc``, ``kvgate import``, reconcile)."""

    __tablename__ = "event_log"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    """Never reused (SQLite AUTOINCREMENT, a PostgreSQL sequence): the log's order."""
    kind: Mapped[int] = mapped_column(SmallInteger)
    """0 stored, 1 removed, 2 release (a PUT of this key ended without a store: its children wait no more), 3 a
    namespace's config removed (``key`` the namespace, ``model`` the model its config named)."""
    key: Mapped[str] = mapped_column(String(512))
    size: Mapped[int] = mapped_column(BigInteger)
    digest: Mapped[str] = mapped_column(String(80))
    meta: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The block meta the writer sent, whole, in the header's own form (``contract.wire.BlockMetaValue.header``;
    NULL: the writer sent none). One value, never a column per field: a new field of the meta changes no table
    (alembic 0009 folded the per-field columns of 0006 into it)."""
    waits_for: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The tokens of the PUTs of the parent that were in progress in the committing process and had not queued their
    change, comma-separated: each owes a row of the parent's key after this one (its store, or a release row), and
    this row is published after them."""
    model: Mapped[str | None] = mapped_column(Text, nullable=True)
    """Of a config's removal: the model name the config gave (its blocks' rows before it go under that topic)."""
    token: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """The token of the PUT that wrote this row, when rows of children wait for it."""

    __table_args__ = (
        Index("ix_event_log_config", "key", sqlite_where=text("kind = 3"), postgresql_where=text("kind = 3")),
        {"sqlite_autoincrement": True},
    )


class EventBatchRow(Base):
    """A published batch: its sequence number, the log rows it holds in their order, and its topic."""

    __tablename__ = "event_batches"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    ts: Mapped[float] = mapped_column(Float)
    topic: Mapped[str] = mapped_column(String(1024))
    ids: Mapped[str] = mapped_column(Text)
    """The log rows' ids, comma-separated, in the batch's order."""
    low: Mapped[int] = mapped_column(BigInteger)
    """The smallest of them (the log is trimmed below the oldest batch kept)."""


class EventState(Base):
    """Where the publisher stands: the next sequence number, the last log row it covered, the rows it holds for
    their parents, and the term of the publisher that wrote it (a publisher that lost its turn cannot write)."""

    __tablename__ = "event_state"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    term: Mapped[int] = mapped_column(BigInteger)
    next_seq: Mapped[int] = mapped_column(BigInteger)
    last_id: Mapped[int] = mapped_column(BigInteger)
    held: Mapped[str] = mapped_column(Text, default="")
    """The ids of the rows held, comma-separated."""
    waiting: Mapped[str] = mapped_column(Text, default="{}")
    """JSON: the token of each PUT that held rows still wait for -> its key."""


class StagingIntent(Base):
    """A version object (S3) or a part's object being written and not yet committed: recorded, with the DATABASE's
    clock, before the object is written. The commit that names the object deletes its intent in its own transaction
    and is refused if it is gone; a sweep deletes an intent only once it is old by the same clock, and removes the
    object only if it did. So a swept object is never committed and a committed one never swept, whatever the
    clocks of the writer's and the sweeper's machines say (alembic 0008)."""

    __tablename__ = "staging"

    key: Mapped[str] = mapped_column(String(640), primary_key=True)
    """The block's key (a version object), or the part object's store key."""
    stamp: Mapped[str] = mapped_column(String(80), primary_key=True)
    """The version's stamp; '' for a part's object."""
    staged_at: Mapped[float] = mapped_column(Float)
    """Seconds since the epoch by the database's clock."""
