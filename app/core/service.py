"""BlockService: the one owner of each key's life. Every change of a key (PUT, part assembly, DELETE, eviction,
purge, import, repair) is made here, under that key's lock, in one order:

1. the new version is written in full and checked, invisible (``store.stage``: a temp file, a new S3 object);
2. under the key's lock, one index transaction swaps the row to the new version (reading the row it replaces,
   and refusing a create-only PUT of a present key): this is the write's point in the key's history;
3. the store publishes that version (the filesystem's rename; nothing on S3, where the row names the object),
   then the cache and the usage figures follow. If 3 fails the row is put back and the staged bytes dropped.

Removal is the same in reverse: the row goes first (only if it still names the version chosen), then the data.

Why it holds: a row names its version by a stamp (the file's inode and mtime, or the S3 object's own name), and a
reader opens only the version its row names, so a body is always served with the ETag of its own row; and since a
key's row changes only under its lock, in commit order, and a failed change is undone before the lock is released,
the rows of a key are one linear history of acknowledged writes. After a crash between 2 and 3, the file's stamp
differs from its row's: reconcile finds those keys by a stat (no re-hashing of the whole store) and re-reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from app.core.events import NO_EVENTS, EventSink
from app.core.keystate import BlockMeta, KeyLocks, MetaCache
from app.core.parts import ByteSpan, PartAssembler, PartOutcome
from app.core.reads import OpenBlock
from app.core.removal import Removal
from app.errors import (
    BlockNotFound,
    Conflict,
    InvalidRequest,
    KVGateError,
    LayoutMismatch,
    NamespaceNotFound,
    PreconditionFailed,
    VersionMismatch,
)
from app.index import BlockRecord, Index
from app.storage import BlockStore
from app.storage.base import BodyChecker, Staged
from contract.keys import (
    BlockKey,
    InvalidKey,
    check_block_paths,
    check_namespace_fields,
    config_path,
    parse_block_key,
    parse_namespace,
)

log = logging.getLogger("kvgate.service")

MAX_CONFIG_BYTES = 64 * 1024
"""The largest namespace config (a run's FileMapper fields are a few hundred bytes to a few KiB)."""
OPEN_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class PutResult:
    meta: BlockMeta
    created: bool


@dataclass(slots=True)
class Counters:
    """In-process counters of block reads, for /v1/stats and /metrics (GET and HEAD; lookups are not reads)."""

    hits: int = 0
    misses: int = 0


class CapacityHook(Protocol):
    """Capacity (app/core/eviction.py): admission of writes, and the usage figures every change of a key updates."""

    async def admit(self, *, namespace: str, size: int, replacing: int, whole: int | None = None) -> None:
        """Reserve room for ``size`` bytes (replacing ``replacing``), evicting if need be, or raise 507."""

    def release(self, *, namespace: str, size: int) -> None:
        """Drop the reservation made by ``admit`` (the write finished, stored or failed)."""

    def changed(self, *, namespace: str, blocks: int, nbytes: int) -> None:
        """Usage moved by ``blocks`` blocks and ``nbytes`` bytes (a committed change, exact)."""


def parse_key(path: str) -> BlockKey:
    try:
        return parse_block_key(path)
    except InvalidKey as exc:
        raise InvalidRequest(str(exc)) from exc


def _meta(record: BlockRecord) -> BlockMeta:
    return BlockMeta(key=record.key, size=record.size, digest=record.digest, stamp=record.stamp)


class BlockService(Removal):
    def __init__(self, *, store: BlockStore, index: Index, cache: MetaCache) -> None:
        self.store = store
        self.index = index
        self.cache = cache
        self.locks = KeyLocks()
        self.parts = PartAssembler(store=store, index=index, locks=self.locks, commit=self._commit, usage=self._usage)
        self.counters = Counters()
        self.capacity: CapacityHook | None = None
        """Set by create_app (app/core/eviction.py)."""
        self.events: EventSink = NO_EVENTS
        """Told of each committed change (app/core/events.py); set by create_app."""
        self.changing = 0
        """Changes of keys in flight (a usage resync waits for none)."""
        self._versioned = bool(getattr(store, "versioned", False))
        """The store keeps each version as its own object (S3): a replaced version is removed after the swap."""
        self._layouts: dict[str, int | None] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Stop pending deletions of retired versions (objects no row names: reconcile removes them later)."""
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)

    # -- bookkeeping ------------------------------------------------------------------------------------------

    def _usage(self, namespace: str, blocks: int, nbytes: int) -> None:
        if self.capacity is not None and (blocks or nbytes):
            self.capacity.changed(namespace=namespace, blocks=blocks, nbytes=nbytes)

    @contextlib.asynccontextmanager
    async def _changing(self, key: str) -> AsyncIterator[None]:
        """Hold ``key`` for one change. The cache epoch moves when it starts and again when it ends, so a reader
        whose index read overlapped the change (it may have read the row before the change committed) never caches
        what it read, nor does one that read while the key is held (``_row``); the change caches the version it
        made."""
        async with self.locks(key):
            self.changing += 1
            self.cache.epoch += 1
            self.cache.drop(key)
            try:
                yield
            finally:
                self.cache.epoch += 1
                self.changing -= 1

    async def _row(self, key: str, *, fresh: bool = False) -> BlockMeta | None:
        meta = None if fresh else self.cache.get(key)
        if meta is not None:
            return meta
        epoch = self.cache.epoch
        record = await self.index.get(key)
        if record is None:
            return None
        meta = _meta(record)
        if not self.locks.held(key):  # a change of the key in flight may not have committed yet: do not keep it
            self.cache.put(meta, read_at_epoch=epoch)
        return meta

    async def _discard(self, staged: Staged) -> None:
        try:
            await self.store.discard(staged)
        except KVGateError as exc:  # a leftover temp file or object: reconcile sweeps those
            log.warning("could not drop staged data key=%s: %s", staged.key, exc)

    async def _check_layout(self, key: BlockKey, size: int) -> None:
        """422 if the namespace's recorded layout gives its blocks another byte size."""
        if key.namespace not in self._layouts:
            record = await self.index.get_namespace(key.namespace)
            expected = record.fields.get("block_bytes") if record is not None else None
            self._layouts[key.namespace] = expected if isinstance(expected, int) else None
            if len(self._layouts) > 4096:
                self._layouts.pop(next(iter(self._layouts)))
        expected = self._layouts[key.namespace]
        if expected is not None and size != expected:
            raise LayoutMismatch(
                f"namespace {key.namespace!r} records blocks of {expected} bytes (block_bytes); this one has {size}"
            )

    async def _admit(self, namespace: str, size: int, replacing: int, whole: int | None = None) -> bool:
        if self.capacity is None:
            return False
        await self.capacity.admit(namespace=namespace, size=size, replacing=replacing, whole=whole)
        return True

    # -- writes -----------------------------------------------------------------------------------------------

    async def put(
        self,
        key: BlockKey,
        body: AsyncIterable[bytes],
        *,
        size: int,
        digest: str | None,
        create_only: bool,
    ) -> PutResult:
        path = key.path
        await self._check_layout(key, size)
        existing = await self._row(path)
        if existing is not None and create_only:
            raise PreconditionFailed(f"{path!r} is present (If-None-Match: *)")
        if existing is not None and digest is not None and digest.lower() == existing.digest and size == existing.size:
            checker = BodyChecker(size=size, expected_digest=digest)  # identical re-put: verify, write nothing
            async for chunk in body:
                checker.update(chunk)
            checker.finish()
            return PutResult(meta=existing, created=False)
        admitted = await self._admit(key.namespace, size, existing.size if existing else 0)
        try:
            staged = await self.store.stage(path, body, size=size, expected_digest=digest)
            # the change runs to its end even if the client goes away: a half-made change is never left behind
            return await asyncio.shield(self._commit(key, staged, create_only=create_only, lock=True))
        finally:
            if admitted and self.capacity is not None:
                self.capacity.release(namespace=key.namespace, size=size)

    async def _commit(self, key: BlockKey, staged: Staged, *, create_only: bool, lock: bool = False) -> PutResult:
        """Make ``staged`` the key's version (see the module docstring); ``lock``: take the key's lock here."""
        if lock:
            async with self._changing(key.path):
                return await self._commit_locked(key, staged, create_only=create_only)
        self.cache.epoch += 1
        self.cache.drop(key.path)
        try:
            return await self._commit_locked(key, staged, create_only=create_only)
        finally:
            self.cache.epoch += 1

    async def _commit_locked(self, key: BlockKey, staged: Staged, *, create_only: bool) -> PutResult:
        path, now = key.path, time.time()
        record = BlockRecord(
            key=path,
            namespace=key.namespace,
            rank=key.rank,
            group=key.group,
            size=staged.meta.size,
            digest=staged.meta.digest,
            created_at=now,
            last_access=now,
            hits=0,
            stamp=staged.stamp,
        )
        try:
            swap = await self.index.swap_block(record, create_only=create_only)
        except BaseException:
            await self._discard(staged)
            raise
        if not swap.written and swap.old is not None:  # create-only on a present key, or the same bytes
            await self._discard(staged)
            if create_only:
                raise PreconditionFailed(f"{path!r} is present (If-None-Match: *)")
            return PutResult(meta=_meta(swap.old), created=False)
        try:
            await self.store.publish(staged)
        except BaseException:
            # the row names a version that is not there: put the old row back; a miss or the old bytes, never a lie
            with contextlib.suppress(KVGateError):
                await self.index.restore_block(key=path, stamp=staged.stamp, old=swap.old)
            await self._discard(staged)
            raise
        old = swap.old
        if old is not None and self._versioned and old.stamp != staged.stamp:
            self._retire(path, old.stamp)
        meta = _meta(record)
        self.cache.put(meta)
        self.events.stored(record)
        self._usage(key.namespace, 0 if old else 1, record.size - (old.size if old else 0))
        return PutResult(meta=meta, created=old is None)

    async def put_part(
        self, key: BlockKey, body: AsyncIterable[bytes], *, span: ByteSpan, part_digest: str | None, create_only: bool
    ) -> PartOutcome:
        """Store one byte range of a multi-part object; the object is published when the parts cover it."""
        await self._check_layout(key, span.total)
        if create_only and await self._row(key.path) is not None:
            raise PreconditionFailed(f"{key.path!r} is present (If-None-Match: *)")
        admitted = await self._admit(key.namespace, span.size, 0, whole=span.total)
        try:
            return await self.parts.put_part(key, body, span=span, part_digest=part_digest)
        finally:
            if admitted and self.capacity is not None:
                self.capacity.release(namespace=key.namespace, size=span.size)

    # -- reads ------------------------------------------------------------------------------------------------

    async def head(self, key: BlockKey) -> BlockMeta:
        meta = await self._row(key.path)
        if meta is None:
            self.counters.misses += 1
            raise BlockNotFound(key.path)
        self.counters.hits += 1
        return meta

    async def open(self, key: BlockKey) -> OpenBlock:
        """The version the index names, opened: body, size and digest of one version, always together."""
        path = key.path
        for attempt in range(OPEN_ATTEMPTS + 1):
            if attempt == OPEN_ATTEMPTS:
                # no change in flight, and the data is still not the version its row names: repair, then a last look
                log.warning("stored data is not its row's version key=%s: repairing", path)
                await self.repair(key)
            meta = await self._row(path, fresh=attempt > 0)
            if meta is None:
                break
            try:
                reader = await self.store.open(path, stamp=meta.stamp)
            except (VersionMismatch, BlockNotFound):
                self.cache.drop(path)
                await self.locks.settle(path)  # a change of this key in flight: read after it
                continue
            if reader.size != meta.size:  # a row without a stamp (written before 0003) that no longer fits
                await reader.aclose()
                self.cache.drop(path)
                continue
            self.counters.hits += 1
            self.index.touch(path)
            return OpenBlock(meta, reader)
        self.counters.misses += 1
        raise BlockNotFound(path)

    async def lookup(self, paths: list[str]) -> tuple[int, list[tuple[int, str] | None]]:
        """Length of the longest present prefix of ``paths``, and each path's (size, digest) (None: absent)."""
        try:  # a path that parses is its own canonical form: the index is asked for the paths as sent
            check_block_paths(paths)
        except InvalidKey as exc:
            raise InvalidRequest(str(exc)) from exc
        found = await self.index.sizes_many(paths)
        slots = [found.get(p) for p in paths]
        prefix = 0
        for slot in slots:
            if slot is None:
                break
            prefix += 1
        return prefix, slots

    # -- namespaces -------------------------------------------------------------------------------------------

    async def put_config(self, namespace: str, fields: dict[str, Any], raw: bytes) -> bool:
        """Store a namespace's fields (checked against its name); True if new. ``raw`` is stored verbatim."""
        try:
            parse_namespace(namespace)
        except InvalidKey as exc:
            raise InvalidRequest(str(exc)) from exc
        if len(raw) > MAX_CONFIG_BYTES:
            raise InvalidRequest(f"namespace config is {len(raw)} bytes; at most {MAX_CONFIG_BYTES}")
        if not isinstance(fields.get("model_name"), str):
            raise InvalidRequest("namespace config needs the run's FileMapper fields ('model_name' and the rest)")
        try:
            check_namespace_fields(namespace, fields)
        except InvalidKey as exc:
            raise Conflict(str(exc)) from exc
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"namespace config fields cannot be hashed: {exc}") from exc
        current = await self.index.get_namespace(namespace)
        if current is not None and current.fields != fields:
            raise Conflict(f"namespace {namespace!r} holds other fields")

        async def body() -> AsyncIterator[bytes]:
            yield raw

        await self.store.put(config_path(namespace), body(), size=len(raw))
        self._layouts.pop(namespace, None)
        created = await self.index.put_namespace(name=namespace, fields=fields)
        self.events.namespace_config(namespace, fields)  # the model name in the events' topic
        return created

    async def get_config(self, namespace: str) -> dict[str, Any]:
        try:
            parse_namespace(namespace)
        except InvalidKey as exc:
            raise InvalidRequest(str(exc)) from exc
        record = await self.index.get_namespace(namespace)
        if record is None:
            raise NamespaceNotFound(namespace)
        return record.fields
