"""Tables. Any change here comes with an alembic revision under alembic/versions."""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, Index, Integer, LargeBinary, MetaData, String, Text
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
