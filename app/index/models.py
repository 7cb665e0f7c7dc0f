"""Tables. Any change here comes with an alembic revision under alembic/versions."""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, Index, Integer, MetaData, String, Text
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
    created_at: Mapped[float] = mapped_column(Float)
    last_access: Mapped[float] = mapped_column(Float)
    hits: Mapped[int] = mapped_column(BigInteger, default=0)
    stamp: Mapped[str | None] = mapped_column(String(80), nullable=True)
    """The stored version this row describes (app.storage.base.Staged.stamp); NULL for rows older than 0003."""

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
    store_key: Mapped[str] = mapped_column(String(640))
    created_at: Mapped[float] = mapped_column(Float)
