"""The core, assembled: every piece built with its collaborators as constructor arguments, in one place, in the
order they depend on each other. The server (create_app), ``kvgate gc`` and ``kvgate import`` all open it here,
over the same data directory's coordination file, so they share each key's lock and the cache epochs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread

from app.backends import Backends
from app.config import Settings
from app.core.capacity import Capacity
from app.core.coordination import Coordinator, open_coordinator
from app.core.event_sink import NO_EVENTS, EventSink
from app.core.keystate import KeyLocks, MetaCache
from app.core.ownership import bind
from app.core.parts import PartAssembler
from app.core.scrub import Scrub
from app.core.service import BlockService
from app.core.upkeep import Upkeep
from app.core.usage import Usage
from app.core.versions import Versions
from app.index import Index
from app.storage import BlockStore


@dataclass(frozen=True, slots=True)
class Core:
    store: BlockStore
    index: Index
    cache: MetaCache
    versions: Versions
    upkeep: Upkeep
    capacity: Capacity
    service: BlockService
    coordinator: Coordinator
    """The data directory's coordination file (key locks, cache epochs, the named exclusive locks)."""
    scrub: Scrub
    """Stored bytes checked against their rows in the background (started by the server only)."""


def _local_resources(settings: Settings) -> list[Path]:
    """The store root and index file that only this machine's processes use (the filesystem, SQLite)."""
    found = [settings.blocks_root] if settings.blocks_root is not None else []
    url = settings.resolved_db_url
    if settings.is_sqlite and ":///" in url and ":memory:" not in url:
        found.append(Path(url.split(":///", 1)[1]).resolve())
    return [p for p in found if p is not None and p.exists()]


@contextlib.asynccontextmanager
async def open_core(
    backends: Backends,
    *,
    settings: Settings,
    events: EventSink = NO_EVENTS,
    cache: bool = True,
    on_coordination_lost: Callable[[], None] | None = None,
) -> AsyncIterator[Core]:
    """The core over opened backends; ``cache``: keep a metadata cache (a one-off tool needs none);
    ``on_coordination_lost``: called once if the coordination file is found removed or replaced (the cache is
    dropped and changes refused from then on: a gateway worker restarts)."""
    coordinator = await anyio.to_thread.run_sync(
        functools.partial(open_coordinator, settings.data_dir, on_lost=on_coordination_lost)
    )
    try:
        for resource in _local_resources(settings):  # ClaimedElsewhere: another data directory coordinates it
            await anyio.to_thread.run_sync(bind, coordinator, resource)
        store, index = backends.store, backends.index
        locks = KeyLocks(coordinator)
        meta_cache = MetaCache(
            entries=settings.meta_cache_entries if cache else 0, ttl_s=settings.meta_cache_ttl_s, epochs=locks.epochs
        )
        usage = Usage()
        versions = Versions(store=store, index=index, locks=locks, cache=meta_cache, usage=usage, events=events)
        parts = PartAssembler(store=store, index=index, versions=versions, max_parts=settings.max_parts_per_object)
        upkeep = Upkeep(versions=versions, parts=parts, store=store, index=index)
        capacity = Capacity(usage=usage, upkeep=upkeep, index=index, coordinator=coordinator, settings=settings)
        service = BlockService(
            versions=versions, parts=parts, admission=capacity, repair=upkeep, store=store, index=index, events=events
        )
        scrub = Scrub(
            upkeep=upkeep,
            index=index,
            coordinator=coordinator,
            bytes_per_s=settings.scrub_bytes_per_s,
            interval_s=settings.scrub_interval_s,
            delay_s=settings.scrub_delay_s,
        )
        watch = asyncio.create_task(coordinator.watch()) if on_coordination_lost is not None else None
        try:
            yield Core(
                store=store,
                index=index,
                cache=meta_cache,
                versions=versions,
                upkeep=upkeep,
                capacity=capacity,
                service=service,
                coordinator=coordinator,
                scrub=scrub,
            )
        finally:
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
            await scrub.close()
            await capacity.close()
            await versions.close()
    finally:
        coordinator.close()
