"""The durable index: SQLAlchemy 2 async over SQLite (WAL) or PostgreSQL, migrated by alembic."""

from app.index.repository import BlockRecord, Index, NamespaceRecord, PartRecord

__all__ = ["BlockRecord", "Index", "NamespaceRecord", "PartRecord"]
