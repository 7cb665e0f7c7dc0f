"""The durable index: SQLAlchemy 2 async over SQLite (WAL) or PostgreSQL, migrated by alembic."""

from app.index.engine import make_engine
from app.index.records import BlockRecord, Candidate, NamespaceRecord, NamespaceUsage, PartRecord, Swap
from app.index.repository import Index

__all__ = [
    "BlockRecord",
    "Candidate",
    "Index",
    "NamespaceRecord",
    "NamespaceUsage",
    "PartRecord",
    "Swap",
    "make_engine",
]
