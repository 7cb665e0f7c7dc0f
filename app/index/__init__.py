"""The durable index: SQLAlchemy 2 async over SQLite (WAL) or PostgreSQL, migrated by alembic."""

from app.index.engine import make_engine
from app.index.records import (
    ABSENT,
    ANY,
    BlockRecord,
    Expect,
    LogNote,
    NamespaceRecord,
    NamespaceUsage,
    PartRecord,
    Swap,
    Upload,
)
from app.index.repository import Index
from app.index.staging import FENCED, Fenced

__all__ = [
    "ABSENT",
    "ANY",
    "FENCED",
    "BlockRecord",
    "Expect",
    "Fenced",
    "Index",
    "LogNote",
    "NamespaceRecord",
    "NamespaceUsage",
    "PartRecord",
    "Swap",
    "Upload",
    "make_engine",
]
