"""open_backends(settings): the store and the index, opened the same way by the server, import and gc.

One place decides how they open (the data directory, the store's start, the schema migrations, the SQLite
synchronous mode and busy timeout, the access-time flush interval) and closes them in the reverse order, also when
opening the second fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio.to_thread

from app.config import Settings
from app.index import Index, make_engine
from app.index.migrate import upgrade_head
from app.storage import BlockStore, build_store


@dataclass(frozen=True, slots=True)
class Backends:
    store: BlockStore
    index: Index


@contextlib.asynccontextmanager
async def open_backends(settings: Settings) -> AsyncIterator[Backends]:
    """The configured store, started, and the index, migrated to head and started; both closed on exit."""
    await anyio.to_thread.run_sync(lambda: settings.data_dir.mkdir(parents=True, exist_ok=True))
    store = build_store(settings.backend, settings=settings)
    await store.start()
    try:
        await upgrade_head(settings.resolved_db_url)
        index = Index(
            make_engine(
                settings.resolved_db_url,
                sqlite_synchronous=settings.sqlite_synchronous,
                busy_timeout_s=settings.sqlite_busy_timeout_s,
                sqlite_mmap_bytes=settings.sqlite_mmap_bytes,
            ),
            flush_interval_s=settings.access_flush_interval_s,
            events=settings.events_enabled,  # every change adds its event-log row, whoever makes it
        )
        await index.start()
        try:
            yield Backends(store=store, index=index)
        finally:
            await index.close()
    finally:
        await store.close()
