"""An index with the event log on, in process (a real SQLite file), for tests of the publisher and the feed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from app.index import BlockRecord, Index, LogNote, make_engine
from app.index.migrate import upgrade_head
from contract.wire import BlockMetaValue

FIRST_SEQ = 1000


@contextlib.asynccontextmanager
async def log_index(db_url: str, *, first_seq: int = FIRST_SEQ) -> AsyncIterator[Index]:
    """A migrated index over ``db_url`` that logs events, with the stream's state created."""
    await upgrade_head(db_url)
    index = Index(make_engine(db_url), flush_interval_s=3600, events=True)
    await index.start()
    try:
        await index.event_log.init(first_seq=first_seq)
        yield index
    finally:
        await index.close()


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'index.db'}"


def record(key: str, *, size: int = 1, digest: str = "0" * 64, stamp: str | None = None) -> BlockRecord:
    return BlockRecord(
        key=key,
        namespace=key.split("_r0/")[0],
        rank=0,
        group=0,
        size=size,
        digest=digest,
        created_at=0.0,
        last_access=0.0,
        hits=0,
        stamp=stamp,
    )


def note(*tokens: int, parent: str | None = None, waits_for: tuple[int, ...] = (), token: int | None = None) -> LogNote:
    """A writer's note with the block meta ``parent``/``tokens``, as app/events/writer.py makes it."""
    return LogNote(meta=BlockMetaValue(parent=parent, tokens=tokens).header(), waits_for=waits_for, token=token)
