"""Removal, adoption and repair of keys: the half of BlockService that takes versions away or re-reads them.

Each method changes a key under its lock (``BlockService._changing``), row first, then data; the usage figures
move by the exact rows removed or recorded. Kept apart from app/core/service.py only for size: it is BlockService.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from app.core.events import EventSink
from app.core.keystate import BlockMeta, MetaCache
from app.core.parts import PartAssembler
from app.errors import BlockNotFound, InvalidRequest, KVGateError, NamespaceNotFound
from app.index import BlockRecord, Candidate, Index
from app.storage import BlockStore
from contract.keys import BlockKey, InvalidKey, config_path, parse_block_key, parse_namespace

log = logging.getLogger("kvgate.service")

REMOVE_CONCURRENCY = 16
RETIRE_AFTER_S = 5.0
"""A replaced or removed S3 version object is deleted this long after its row stopped naming it, so that a GET that
opened it just before has started reading it (an S3 GET in progress reads to the end after a delete)."""


@dataclass(frozen=True, slots=True)
class PurgeReport:
    blocks: int
    bytes: int
    config: bool


def _version_of(record: BlockRecord) -> Candidate:
    """The version a row names, as removal's ``expect`` (removed only if the row still names it)."""
    return Candidate(
        key=record.key, namespace=record.namespace, size=record.size, created_at=record.created_at, stamp=record.stamp
    )


class Removal:
    """Mixed into BlockService; the attributes below are BlockService's."""

    store: BlockStore
    index: Index
    cache: MetaCache
    parts: PartAssembler
    _versioned: bool
    _retiring: set[asyncio.Task[None]]
    _layouts: dict[str, int | None]
    events: EventSink
    _usage: Callable[[str, int, int], None]
    _changing: Callable[[str], AbstractAsyncContextManager[None]]

    def _retire(self, key: str, stamp: str | None) -> None:
        """Delete a version object (S3) that no row names any more, after RETIRE_AFTER_S."""

        async def later() -> None:
            await asyncio.sleep(RETIRE_AFTER_S)
            try:
                await self.store.remove(key, stamp=stamp)
            except KVGateError as exc:  # an object no row names: reconcile removes it
                log.warning("could not remove retired version key=%s stamp=%s: %s", key, stamp, exc)

        task = asyncio.get_running_loop().create_task(later(), name="kvgate-retire")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    # -- removal ----------------------------------------------------------------------------------------------

    async def _remove_locked(self, key: str, *, expect: Candidate | None = None) -> BlockRecord | None:
        """Remove the key's row, then its data; with ``expect``, only if the row still names that version."""
        if expect is None:
            old = await self.index.remove_block(key)
        else:
            old = await self.index.remove_block(key, stamp=expect.stamp, any_version=False)
        if old is None:
            return None
        self._usage(old.namespace, -1, -old.size)
        self.events.removed(old)
        if self._versioned:
            self._retire(key, old.stamp)
            return old
        try:
            await self.store.remove(key, stamp=old.stamp)  # the filesystem: an open reader's fd keeps its inode
        except KVGateError as exc:  # data without a row: reconcile adopts or removes it
            log.warning("row removed, data not key=%s: %s", key, exc)
        return old

    async def delete(self, key: BlockKey) -> None:
        path = key.path

        async def run() -> bool:
            async with self._changing(path):
                old = await self._remove_locked(path)
                dropped = await self.parts.drop(path)
                orphan = False if old is not None else await self.store.delete(path)  # data no row described
                return old is not None or orphan or dropped > 0

        if not await asyncio.shield(run()):
            raise BlockNotFound(path)

    async def evict(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Remove each candidate whose row still names the version chosen; the ones removed."""
        sem = asyncio.Semaphore(REMOVE_CONCURRENCY)

        async def one(c: Candidate) -> bool:
            async with sem, self._changing(c.key):
                return await self._remove_locked(c.key, expect=c) is not None

        done = await asyncio.gather(*(one(c) for c in candidates))
        return [c for c, ok in zip(candidates, done, strict=True) if ok]

    async def purge(self, namespace: str) -> PurgeReport:
        """Remove a namespace: its blocks (rows, then data), data no row describes, incomplete uploads, config."""
        try:
            parse_namespace(namespace)
        except InvalidKey as exc:
            raise InvalidRequest(str(exc)) from exc
        blocks = await self.index.namespace_blocks(namespace)
        has_config = await self.index.get_namespace(namespace) is not None
        known = {k for k, _ in blocks}
        orphans: list[str] = []
        async for info in self.store.list(prefix=f"{namespace}_r"):
            with contextlib.suppress(InvalidKey):
                if parse_block_key(info.key).namespace == namespace and info.key not in known:
                    orphans.append(info.key)
        uploads = [k for k in await self.index.part_bytes() if k.startswith(f"{namespace}_r")]
        if not blocks and not has_config and not orphans and not uploads:
            raise NamespaceNotFound(namespace)
        sem = asyncio.Semaphore(REMOVE_CONCURRENCY)

        async def one(key: str) -> int:
            async with sem, self._changing(key):
                old = await self._remove_locked(key)
                await self.parts.drop(key)
                if old is None:
                    await self.store.delete(key)
                return 0 if old is None else old.size

        sizes = await asyncio.gather(*(one(k) for k in sorted({*known, *orphans, *uploads})))
        removed = sum(1 for s in sizes if s)
        if has_config:
            await self.store.delete(config_path(namespace))
            await self.index.delete_namespace(namespace)
        self._layouts.pop(namespace, None)
        return PurgeReport(blocks=removed, bytes=sum(sizes), config=has_config)

    # -- adoption and repair ----------------------------------------------------------------------------------

    async def adopt(self, key: BlockKey) -> BlockMeta | None:
        """Record the data stored under ``key`` as it is now (re-read and hashed); None if there is none."""
        async with self._changing(key.path):
            return await self._adopt_locked(key)

    async def _adopt_locked(self, key: BlockKey) -> BlockMeta | None:
        try:
            stored = await self.store.digest(key.path)
        except BlockNotFound:
            old = await self._remove_locked(key.path)
            if old is not None:
                log.warning("repair: no data for key=%s, row dropped", key.path)
            return None
        now = time.time()
        record = BlockRecord(
            key=key.path,
            namespace=key.namespace,
            rank=key.rank,
            group=key.group,
            size=stored.size,
            digest=stored.digest,
            created_at=now,
            last_access=now,
            hits=0,
            stamp=stored.stamp,
        )
        swap = await self.index.swap_block(record, create_only=False)
        old = swap.old
        if swap.written:
            self.events.stored(record)
        if not swap.written and old is not None and old.stamp != stored.stamp:  # same bytes, another stamp
            await self.index.adopt_many([record])
        self._usage(key.namespace, 0 if old else 1, stored.size - (old.size if old else 0))
        return BlockMeta(key=key.path, size=stored.size, digest=stored.digest, stamp=stored.stamp)

    async def repair(self, key: BlockKey) -> bool:
        """A reader found no stored version its row names, with no change of the key in flight. On a filesystem
        the file is re-read: the row's bytes under another stamp (copied, touched) keep the row with the new stamp;
        other bytes are corruption or a change behind the gateway's back, and row and file go (a miss, never data
        the row does not vouch for). On S3 a row whose version object is gone is dropped. True if the row stands."""
        async with self._changing(key.path):
            record = await self.index.get(key.path)
            if record is None:
                return True
            if not self._versioned:
                return await self._verify_locked(record)
            try:
                reader = await self.store.open(key.path, stamp=record.stamp)
            except BlockNotFound:
                if await self._remove_locked(key.path, expect=_version_of(record)) is not None:
                    log.warning("repair: version object gone key=%s stamp=%s, row dropped", key.path, record.stamp)
                return False
            await reader.aclose()
            return True

    async def _verify_locked(self, record: BlockRecord) -> bool:
        """True if the row stands (re-stamped if its bytes are there under another stamp)."""
        expect = _version_of(record)
        try:
            stored = await self.store.digest(record.key)
        except BlockNotFound:
            if await self._remove_locked(record.key, expect=expect) is not None:
                log.warning("repair: no data for key=%s, row dropped", record.key)
            return False
        if (stored.size, stored.digest) == (record.size, record.digest):
            await self.index.adopt_many([dataclasses.replace(record, stamp=stored.stamp)])
            return True
        log.error("corrupt block key=%s: stored sha256 %s, row %s; removed", record.key, stored.digest, record.digest)
        await self._remove_locked(record.key, expect=expect)
        return False

    async def adopt_records(self, records: Iterable[BlockRecord]) -> None:
        """Record versions reconcile found and hashed (before the gateway serves, or from ``kvgate gc``)."""
        records = list(records)
        await self.index.adopt_many(records)
        self.events.stored_many(records)
        for r in records:
            self.cache.drop(r.key)

    async def forget(self, keys: Sequence[str]) -> int:
        """Drop rows whose data is gone (reconcile)."""
        for key in keys:
            self.cache.drop(key)
        dropped = await self.index.delete_blocks(keys)
        self.events.removed_keys(keys)
        return dropped
