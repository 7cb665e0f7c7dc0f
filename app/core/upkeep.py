"""Upkeep: the changes nobody asked for by key. Eviction, purge, the sweep of abandoned uploads and of staged data
left by crashes, repair of a key whose data is not its row's version, adoption of data found without a row, and
the admin views. Capacity, reconcile (start-up and ``kvgate gc``), ``kvgate import`` and the admin routes use it.

Every method decides *under the key's hold* (``Versions.change``), from what it reads there, and commits only if the
key is still what it read (compare-and-set on the version): a decision made from an earlier snapshot (reconcile's
listing, eviction's LRU candidates) can never remove or replace a version written since. Recovery rolls forward:
a staged version that a committed row names is published, never deleted; bytes of a version this store wrote are
recorded, never removed as "corrupt" because of a timestamp. The crash points and what recovery does at each are
in ARCHITECTURE.md (Design, "Crashes roll forward").
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from app.core.parts import PartAssembler
from app.core.versions import Change, Versions, meta_of
from app.errors import (
    BlockNotFound,
    CorruptData,
    DigestMismatch,
    KVGateError,
    NamespaceNotFound,
    SizeMismatch,
    VersionMismatch,
)
from app.index import ABSENT, BlockRecord, Index, NamespaceUsage, Upload
from app.storage import BlockStore
from app.storage.base import BodyChecker, Leftover, Version
from app.storage.checksums import algorithm_of
from contract.keys import BlockKey, InvalidKey, config_path, parse_block_key, parse_namespace

log = logging.getLogger("kvgate.upkeep")

REMOVE_CONCURRENCY = 16


class Settled(enum.Enum):
    """What repairing a key found and did (``Upkeep.repair``)."""

    KEPT = "kept"
    """the row's version is there (a change was in flight, now done)"""
    ROLLED = "rolled"
    """the row's version was staged and never published (a crash): published now"""
    RESTAMPED = "restamped"
    """the row's bytes were there under another stamp (copied back, touched): recorded with a stamp of ours"""
    RECORDED = "recorded"
    """the row's own bytes are gone; a whole version this store wrote was there and is now the row's"""
    ADOPTED = "adopted"
    """data without a row, now recorded"""
    DROPPED = "dropped"
    """the row's version is gone and nothing else stands for it: the row was removed"""
    CORRUPT = "corrupt"
    """other bytes than the row's, written behind the gateway's back: data quarantined, then the row removed"""
    ABSENT = "absent"
    """no row and no data"""

    @property
    def stands(self) -> bool:
        return self not in (Settled.DROPPED, Settled.CORRUPT, Settled.ABSENT)


@dataclass(frozen=True, slots=True)
class PurgeReport:
    blocks: int
    bytes: int
    config: bool


@dataclass(frozen=True, slots=True)
class NamespaceViews:
    """What the admin routes show: per-namespace aggregates of the rows, and the namespaces with fields."""

    usage: list[NamespaceUsage]
    configured: set[str]


class Upkeep:
    def __init__(self, *, versions: Versions, parts: PartAssembler, store: BlockStore, index: Index) -> None:
        self._versions = versions
        self._parts = parts
        self._store = store
        self._index = index

    # -- eviction and uploads ---------------------------------------------------------------------------------

    async def evict(self, candidates: Sequence[BlockRecord]) -> list[BlockRecord]:
        """Remove each candidate whose row still names the version chosen; the ones removed."""
        sem = asyncio.Semaphore(REMOVE_CONCURRENCY)

        async def one(c: BlockRecord) -> bool:
            async with sem, self._versions.change(c.key) as change:
                try:
                    return await change.remove(expect=c.stamp) is not None
                except KVGateError as exc:  # the row went, the data stays: reconcile adopts it again
                    log.warning("evicted row, data not removed key=%s: %s", c.key, exc)
                    return True

        done = await asyncio.gather(*(one(c) for c in candidates))
        return [c for c, ok in zip(candidates, done, strict=True) if ok]

    async def drop_upload(self, upload: Upload, *, idle_since: float) -> int:
        """Drop an incomplete upload whose newest part is no newer than ``idle_since`` (wall clock); the bytes
        freed. A part recorded since the upload was listed keeps it."""
        async with self._versions.change(upload.key):
            parts = await self._index.get_parts(upload.key)
            if not parts or max(p.created_at for p in parts) > idle_since:
                return 0
            await self._parts.drop(upload.key, parts)
        log.warning("dropped abandoned upload key=%s parts=%d bytes=%d", upload.key, len(parts), upload.bytes)
        return sum(p.end - p.start for p in parts)

    async def drop_idle_uploads(self, *, idle_s: float) -> int:
        """Drop every upload with no part for ``idle_s`` seconds (a writer that died mid-object); how many. Parts
        are timed by the index's clock, and so is the cutoff: never this machine's clock against another's."""
        cutoff = await self._index.staging.db_now() - idle_s
        dropped = 0
        for upload in await self._index.scans.uploads():
            if upload.last_part_at < cutoff and await self.drop_upload(upload, idle_since=cutoff):
                dropped += 1
        return dropped

    # -- purge ------------------------------------------------------------------------------------------------

    async def purge(self, namespace: str) -> PurgeReport:
        """Remove a namespace: its blocks (rows, then data), data no row describes, incomplete uploads, config."""
        parse_namespace(namespace)  # InvalidKey: a 400
        blocks = await self._index.scans.namespace_blocks(namespace)
        has_config = await self._index.get_namespace(namespace) is not None
        known = {k for k, _ in blocks}
        orphans: list[str] = []
        async for info in self._store.list(prefix=f"{namespace}_r"):
            try:
                if parse_block_key(info.key).namespace == namespace and info.key not in known:
                    orphans.append(info.key)
            except InvalidKey:
                continue
        uploads = [u.key for u in await self._index.scans.uploads(namespace=namespace)]
        if not blocks and not has_config and not orphans and not uploads:
            raise NamespaceNotFound(namespace)
        sem = asyncio.Semaphore(REMOVE_CONCURRENCY)

        async def one(key: str) -> int:
            async with sem, self._versions.change(key) as change:
                old = await change.remove()
                await self._parts.drop(key)
                if old is None:
                    await self._store.delete(key)
                return 0 if old is None else old.size

        sizes = await asyncio.gather(*(one(k) for k in sorted({*known, *orphans, *uploads})))
        if has_config:
            await self._store.delete(config_path(namespace))
            await self._index.delete_namespace(namespace)
        return PurgeReport(blocks=sum(1 for s in sizes if s), bytes=sum(sizes), config=has_config)

    # -- repair, adoption, recovery ---------------------------------------------------------------------------

    async def repair(self, key: BlockKey) -> Settled:
        """Settle a key whose data may not be the version its row names (a reader found so, or reconcile's listing
        said so), deciding from what is there now, holding the key (see ``Settled``)."""
        async with self._versions.change(key.path) as change:
            return await self._settle(change, key)

    async def _settle(self, change: Change, key: BlockKey) -> Settled:
        store = self._store
        row = await change.row()
        if row is None:
            try:
                return Settled.ABSENT if await self._adopt_locked(change, key) is None else Settled.ADOPTED
            except CorruptData:
                return Settled.CORRUPT
        if row.stamp is not None and await store.has_version(key.path, row.stamp):
            return Settled.KEPT  # it was a change in flight, now done
        if row.stamp is not None and await store.roll_forward(key.path, row.stamp):
            log.warning("recovery: published the committed version a crash left staged key=%s", key.path)
            return Settled.ROLLED
        if store.versioned:  # the row's own object is gone: nothing else can stand for it
            await change.remove(expect=row.stamp, data=False)
            log.warning("repair: version object gone key=%s stamp=%s, row dropped", key.path, row.stamp)
            return Settled.DROPPED
        algorithm = algorithm_of(row.digest)  # compared in the row's own algorithm (a sha256 row stays one)
        try:
            found = await store.digest(key.path, algorithm=algorithm)
        except BlockNotFound:
            await change.remove(expect=row.stamp, data=False)
            log.warning("repair: no data for key=%s, row dropped", key.path)
            return Settled.DROPPED
        except CorruptData as exc:  # neither the row's bytes nor those sealed: nothing vouches for them
            return await self._condemn_found(change, key, row, stamp=exc.stamp, why=str(exc))
        if (found.size, found.digest) == (row.size, row.digest):
            # the row's bytes under another stamp (copied back, touched): keep them, with a stamp of ours
            claimed = found if store.issued(found.stamp) else await store.claim(key.path, algorithm=algorithm)
            await change.record(key, claimed, expect=row.stamp, created_at=row.created_at)
            return Settled.RESTAMPED
        if store.issued(found.stamp):
            # a whole version this store wrote (the one before the row's, whose own bytes never got published):
            # it was acknowledged once, so it is recorded, not removed
            await change.record(key, found, expect=row.stamp)
            log.warning("recovery: the row's version is gone, kept the version on disk key=%s", key.path)
            return Settled.RECORDED
        why = f"stored {found.digest}, row {row.digest}"
        return await self._condemn_found(change, key, row, stamp=found.stamp, why=why)

    async def _condemn_found(
        self, change: Change, key: BlockKey, row: BlockRecord, *, stamp: str | None, why: str
    ) -> Settled:
        """The bytes found under the key (version ``stamp``), and only them, are moved aside before the row goes: a
        crash in between leaves a row without data (a miss), never corrupt bytes without a row for recovery to adopt
        under a fresh checksum. Decided again if they changed since they were read."""
        log.error("corrupt block key=%s: %s; quarantined", key.path, why)
        if await self._store.quarantine(key.path, stamp=stamp):
            await change.remove(expect=row.stamp, data=False)
            return Settled.CORRUPT
        return await self._settle(change, key)

    async def verify(self, key: BlockKey, *, pace: Callable[[int], Awaitable[None]]) -> tuple[Settled, int]:
        """Read the version the key's row names back, hashed in the row's algorithm (the scrub: app/core/scrub.py),
        without holding the key (the stamp pins the version read); ``pace`` is awaited with each chunk's size.
        KEPT: its bytes are the row's; CORRUPT: they were not (condemned); ABSENT: no row; else what settling a
        row whose version was not there found. With the bytes read."""
        row = await self._index.get(key.path)
        if row is None:
            return Settled.ABSENT, 0
        try:
            reader = await self._store.open(key.path, stamp=row.stamp)
        except (BlockNotFound, VersionMismatch):
            return await self.repair(key), 0
        checker = BodyChecker(size=row.size, expected_digest=row.digest)
        read = 0
        try:
            async with reader:
                async for chunk in reader.chunks(start=0, end=reader.size):
                    checker.update(chunk)
                    read += len(chunk)
                    await pace(len(chunk))
            checker.finish()
        except (DigestMismatch, SizeMismatch):
            return await self.condemn(key, stamp=row.stamp), read
        return Settled.KEPT, read

    async def condemn(self, key: BlockKey, *, stamp: str | None) -> Settled:
        """Version ``stamp`` of the key was read and its bytes are not its row's: holding the key, if the row still
        names it, quarantine those bytes, then remove the row (CORRUPT); KEPT if the key changed since."""
        async with self._versions.change(key.path) as change:
            row = await change.row()
            if row is None or row.stamp != stamp:
                return Settled.KEPT  # another version now: not the bytes judged
            log.error(
                "corrupt block key=%s stamp=%s: bytes are not the row's %s; quarantined", key.path, stamp, row.digest
            )
            if await self._store.quarantine(key.path, stamp=stamp):
                await change.remove(expect=stamp, data=False)
                return Settled.CORRUPT
            return await self._settle(change, key)  # the version is not there any more: settled as found

    async def adopt(self, key: BlockKey) -> Version | None:
        """Record the data stored under ``key`` if no row names a version of it (``kvgate import`` in place,
        reconcile's data without a row); the version recorded or kept, None if there is no data; CorruptData
        (moved aside) if the store sealed other bytes than those."""
        async with self._versions.change(key.path) as change:
            row = await change.row()
            if row is not None:
                return meta_of(row)
            return await self._adopt_locked(change, key)

    async def _adopt_locked(self, change: Change, key: BlockKey) -> Version | None:
        """CorruptData (the bytes moved aside) if the store sealed other bytes than those there now."""
        try:
            claimed = await self._store.claim(key.path)
        except BlockNotFound:
            return None
        except CorruptData as exc:
            await self._quarantine(key, exc)
            raise
        done = await change.record(key, claimed, expect=ABSENT)
        return done.meta

    async def _quarantine(self, key: BlockKey, found: CorruptData) -> bool:
        """Move aside the bytes ``found`` judged rotten, if they are still there; whether they were."""
        log.error("corrupt block key=%s: %s; quarantined", key.path, found)
        return await self._store.quarantine(key.path, stamp=found.stamp)

    async def upgrade_stamp(self, key: BlockKey, *, stamp: str) -> bool:
        """Give a row of an earlier release (its stamp one of that release's) and its data a stamp of this store's
        own, without reading the data, if both still name that version; True if done."""
        async with self._versions.change(key.path) as change:
            row = await change.row()
            if row is None or row.stamp != stamp:
                return False
            new = await self._store.restamp(key.path, stamp=stamp)
            if new is None:
                return False
            meta = dataclasses.replace(meta_of(row), stamp=new)
            return (await change.record(key, meta, expect=stamp, created_at=row.created_at)).written

    async def settle_leftover(self, leftover: Leftover) -> str:
        """A staged version whose writer is gone: published if its key's row names it ("rolled"), else removed
        ("dropped"); "kept" if a writer holds it again."""
        if not leftover.key:
            return "dropped" if await self._store.drop_leftover(leftover) else "kept"
        async with self._versions.change(leftover.key) as change:
            row = await change.row()
            if row is not None and row.stamp == leftover.stamp:
                if await self._store.roll_forward(leftover.key, leftover.stamp):
                    log.warning("recovery: published the committed version a crash left staged key=%s", leftover.key)
                    return "rolled"
                return "kept"
            return "dropped" if await self._store.drop_leftover(leftover) else "kept"

    async def retire_unnamed(self, key: str, *, stamp: str | None, older_than_s: float) -> bool:
        """Remove version ``stamp`` of ``key`` (a versioned store's object) if no row names it and no writer can
        still commit it: its staging intent, if any, is older than ``older_than_s`` by the index's clock and is
        taken, in one transaction that the commit's own excludes (app/index/staging.py). True if removed."""
        async with self._versions.change(key) as change:
            if stamp is None:  # the unversioned object (an earlier release's, or imported): no staging, no intent
                row = await change.row()
                if row is None or row.stamp is None:
                    return False
            elif not await self._index.staging.claim_version(key=key, stamp=stamp, older_than_s=older_than_s):
                return False
            return await self._store.remove(key, stamp=stamp)

    # -- admin views ------------------------------------------------------------------------------------------

    async def views(self, namespace: str | None = None) -> NamespaceViews:
        await self._index.flush_access()  # reads of the last flush interval count
        usage = await self._index.scans.namespace_usage(namespace)
        if namespace is None:
            configured = set(await self._index.scans.namespace_names())
        else:
            configured = {namespace} if await self._index.get_namespace(namespace) is not None else set()
        return NamespaceViews(usage=usage, configured=configured)
