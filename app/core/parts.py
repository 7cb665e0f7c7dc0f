"""Multi-part objects: each TP rank PUTs its byte range of a canonical block with ``Content-Range``.

Part data lives under ``_parts/<key>/...`` (a key the block grammar can never produce: block namespaces never start
with ``_parts/``), and a row goes to the ``parts`` table, create-only on ``(key, start)``. The object stays
invisible (no ``blocks`` row: HEAD/GET 404, lookup miss) until the parts cover ``[0, total)``; the PUT that
completes the cover stages the object, commits it through its key's Change (row, then publish), then drops the parts.
Stored part bytes count against capacity until then. Two ways to keep the data:

- **In place** (a store with ``place``/``stage_upload``: the filesystem): the parts of one object are written
  at their offsets into one upload file, ``_parts/<key>.upload.<uuid>``, the object's own file to be. A part's body
  is streamed to a staged file of its own and checked first (nothing of it is held in memory, whatever its size),
  then copied in the kernel into the upload under the key's lock, only into a range no recorded part holds, and
  recorded. The completing PUT reads the file once (each part's digest checked, the whole hashed) and stages it by
  a hard link: the parts become the object, with no further copy of the bytes.
- **One object per part** (S3, memory): ``_parts/<key>/<start>-<end>.<uuid>``, written outside any lock (each has
  its own store key); the completing PUT streams them, in order and checked, through a staged version.

Bounds: an object has at most ``max_parts`` parts (a further one is a 409); checking a new part against the
recorded ones looks at its two neighbours (the parts are ordered and do not overlap), not at every earlier part.

Concurrency: the bookkeeping and the assembly hold the key (``Versions.change``), which every process of a data
directory shares, so an upload file is written by one part at a time and assembled once. Across replicas sharing
PostgreSQL, recording a part holds the key in its transaction (an advisory lock): of the last two parts of an
object, recorded on two replicas at once, the second to commit sees the first and assembles. A second assembler
(a writer re-sending a part of a covered object whose assembler died) produces the same bytes; one that finds the
parts gone while reading checks that the object was published by the other.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from app.core.event_sink import PutInProgress
from app.core.versions import Change, Versions
from app.errors import (
    BlockNotFound,
    CommitUnknown,
    Conflict,
    DigestMismatch,
    IndexUnavailable,
    SizeMismatch,
    StagingExpired,
)
from app.index import FENCED, Index, PartRecord
from app.storage import BlockStore
from app.storage.base import BodyChecker, Region
from app.storage.checksums import algorithm_of
from contract.keys import BlockKey, InvalidKey, parse_block_key
from contract.wire import DEFAULT_ALGORITHM, SHA256, ByteSpan

log = logging.getLogger("kvgate.parts")

PARTS_PREFIX = "_parts/"
"""Store prefix of part data; reconcile/adopt must skip it (never a block key)."""
UPLOAD_MARK = ".upload."
"""An upload file's store key is ``_parts/<key>.upload.<uuid>`` (in-place parts: the data sits at the part's
offset). A file beside its key's place, not a directory per key: the directories under ``_parts/`` are the blocks'
own few, shared by all keys, so finished uploads leave none behind."""
STAGED_PART = ".part"
"""An in-place part is staged as ``_parts/<key>.part`` (a staged file beside the upload) before it is placed."""
MAX_PARTS = 256
"""The default bound on an object's parts (``Settings.max_parts_per_object``)."""


def in_upload(part: PartRecord) -> bool:
    """``part``'s bytes sit at its own offset of an upload file (else at 0 of an object of their own)."""
    return UPLOAD_MARK in part.store_key.rsplit("/", 1)[-1]


def one_upload(parts: list[PartRecord]) -> str | None:
    """The upload file that holds all of ``parts``, if one does."""
    keys = {p.store_key for p in parts}
    if len(keys) == 1 and in_upload(parts[0]):
        return keys.pop()
    return None


@dataclass(frozen=True, slots=True)
class PartOutcome:
    key: str
    span: ByteSpan
    part_digest: str
    complete: bool
    """True once the object is published (by this PUT or an earlier one)."""
    created: bool
    """False when an identical part (or the whole object) was already there."""
    digest: str | None
    """The object's checksum token once complete."""


def _check_against(parts: list[PartRecord], span: ByteSpan, digest: str | None) -> PartRecord | None:
    """The identical part already recorded (or None); Conflict on another total or an overlapping range. ``parts``
    are ordered by start and do not overlap (each was checked so when recorded): only the neighbours of ``span``
    can overlap it, found by bisection."""
    if parts and parts[0].total != span.total:
        raise Conflict(f"part says the object has {span.total} bytes, an earlier part said {parts[0].total}")
    i = bisect.bisect_left(parts, span.start, key=lambda p: p.start)
    if i < len(parts):
        p = parts[i]
        if p.start == span.start and p.end == span.end and (digest is None or digest == p.digest):
            return p
        if p.start < span.end:
            raise Conflict(f"bytes {span.start}-{span.end - 1} overlap the stored part {p.start}-{p.end - 1}")
    if i > 0 and parts[i - 1].end > span.start:
        p = parts[i - 1]
        raise Conflict(f"bytes {span.start}-{span.end - 1} overlap the stored part {p.start}-{p.end - 1}")
    return None


def _complete(path: str, size: int, digest: str, span: ByteSpan, part_digest: str) -> PartOutcome:
    """The answer to a part of an object already complete (Conflict if the part says it has another size)."""
    if size != span.total:
        raise Conflict(f"{path!r} is complete with {size} bytes, the part says {span.total}")
    return PartOutcome(path, span, part_digest, True, False, digest)


def covers(parts: list[PartRecord], total: int) -> bool:
    """Do ``parts`` (non-overlapping, each inside ``[0, total)``) cover ``[0, total)`` exactly?"""
    return sum(p.end - p.start for p in parts) == total


class PartAssembler:
    """Part bookkeeping and assembly; every step that reads and changes a key's parts holds the key
    (``Versions.change``: across the processes of a machine; across replicas, PostgreSQL holds the key for each
    part's recording transaction, so the part that completes a cover sees all the others)."""

    def __init__(self, *, store: BlockStore, index: Index, versions: Versions, max_parts: int = MAX_PARTS) -> None:
        self._store = store
        self._index = index
        self._versions = versions
        self._max_parts = max_parts

    async def put_part(
        self,
        key: BlockKey,
        body: AsyncIterable[bytes],
        *,
        span: ByteSpan,
        part_digest: str | None,
        put: PutInProgress | None = None,
    ) -> PartOutcome:
        """``put``: the PUT of this part, for the KV events (the object's change, if it completes it)."""
        if self._store.uploads:
            return await self._put_in_place(key, body, span=span, part_digest=part_digest, put=put)
        path = key.path
        existing, parts = await self._index.part_state(path)
        if existing is not None:
            return await self._already_complete(path, existing.size, existing.digest, body, span, part_digest)
        if _check_against(parts, span, part_digest) is None:  # fail fast, before any byte is kept
            self._check_room(parts, span)
        store_key = f"{PARTS_PREFIX}{path}/{span.start}-{span.end}.{uuid.uuid4().hex}"
        await self._index.staging.add_intent(key=store_key)  # before the object exists: no sweep takes it while staged
        keep = False
        try:
            stored = await self._store.put(store_key, body, size=span.size, expected_digest=part_digest)
            async with self._versions.change(path, put=put) as change:
                existing, parts = await self._index.part_state(path)
                if existing is not None:  # completed by another writer while our bytes streamed
                    return PartOutcome(path, span, stored.digest, True, False, existing.digest)
                try:
                    outcome, keep = await self._record(change, key, span, stored.digest, store_key, parts)
                except BaseException:
                    keep = await self._named(path, store_key)  # recorded, then the assembly failed: kept
                    raise
                return outcome
        finally:
            if not keep:
                with contextlib.suppress(Exception):
                    await self._store.delete(store_key)
                    await self._index.staging.drop_intent(key=store_key)

    async def _named(self, path: str, store_key: str) -> bool:
        """A part row of ``path`` names ``store_key`` (read as ``Versions`` reads a row back); True when that cannot
        be read (the object is kept: the sweep of idle uploads drops it with its row, or as an unnamed leftover)."""
        try:
            return any(p.store_key == store_key for p in await self._index.settled_parts(path))
        except IndexUnavailable:
            return True

    async def _put_in_place(
        self,
        key: BlockKey,
        body: AsyncIterable[bytes],
        *,
        span: ByteSpan,
        part_digest: str | None,
        put: PutInProgress | None,
    ) -> PartOutcome:
        """Stream the part's body to a staged file and check it, then, holding the key, copy it into the object's
        upload file (one index read and one write per part)."""
        path = key.path
        staged = await self._store.stage(
            f"{PARTS_PREFIX}{path}{STAGED_PART}", body, size=span.size, expected_digest=part_digest
        )
        try:
            digest = staged.meta.digest
            async with self._versions.change(path, put=put) as change:
                existing, parts = await self._index.part_state(path)
                if existing is not None:  # complete: by an earlier writer, or by another while our bytes arrived
                    return _complete(path, existing.size, existing.digest, span, digest)
                if _check_against(parts, span, digest) is not None:  # the same part again: nothing is written
                    return (await self._record(change, key, span, digest, "", parts))[0]
                upload = one_upload(parts) if parts else f"{PARTS_PREFIX}{path}{UPLOAD_MARK}{uuid.uuid4().hex}"
                offset = span.start
                if upload is None:  # parts kept one object each (written before in-place parts): keep to that
                    upload, offset = f"{PARTS_PREFIX}{path}/{span.start}-{span.end}.{uuid.uuid4().hex}", 0
                self._check_room(parts, span)
                await self._store.place(upload, offset, staged)
                outcome, _ = await self._record(change, key, span, digest, upload, parts)
                return outcome
        finally:
            await self._versions.discard(staged)

    def _check_room(self, parts: list[PartRecord], span: ByteSpan) -> None:
        """Conflict if one more part would take the object past ``max_parts``."""
        if len(parts) >= self._max_parts:
            raise Conflict(
                f"the object has {len(parts)} parts stored, at most {self._max_parts}: send it in fewer, larger parts "
                f"(bytes {span.start}-{span.end - 1} refused)"
            )

    async def _record(
        self, change: Change, key: BlockKey, span: ByteSpan, digest: str, store_key: str, parts: list[PartRecord]
    ) -> tuple[PartOutcome, bool]:
        """Record the stored part (the key is held and ``parts`` were just read) and assemble the object if it is
        now covered; the outcome, and whether the index now keeps the part."""
        path = key.path
        same = _check_against(parts, span, digest)
        keep = False
        if same is None:
            self._check_room(parts, span)
            record = PartRecord(
                key=path, start=span.start, end=span.end, total=span.total, digest=digest, store_key=store_key
            )
            try:
                recorded = await self._index.add_part(record, namespace=key.namespace, intent=not self._store.uploads)
            except CommitUnknown as exc:
                recorded = await self._settle_part(record, exc)
            if recorded is FENCED:
                raise StagingExpired(f"{path!r}: the part's object was swept before it was recorded")
            if recorded is None:  # another replica recorded this start first
                raise Conflict(f"a part starting at byte {span.start} was recorded concurrently")
            keep = True
            self._versions.parts_moved(key.namespace, span.size)
            parts = recorded
        if not covers(parts, span.total):
            return PartOutcome(path, span, digest, False, same is None, None), keep
        total = await self._assemble(change, key, parts, span.total)
        return PartOutcome(path, span, digest, True, same is None, total), keep

    async def _settle_part(self, record: PartRecord, unknown: CommitUnknown) -> list[PartRecord] | None:
        """The key's parts if the part whose recording's outcome is unknown is among them, read back as
        ``Versions`` reads a row back (the same "is it mine?"); IndexUnavailable if it is not, ``unknown`` again if
        they cannot be read."""
        if unknown.result is None:
            return None  # the transaction found the start taken: it recorded nothing
        try:
            parts = await self._index.settled_parts(record.key)
        except IndexUnavailable as exc:
            raise unknown from exc
        mine = (record.start, record.end, record.digest, record.store_key)
        if any((p.start, p.end, p.digest, p.store_key) == mine for p in parts):
            log.warning("commit reply lost, the part is recorded: it stands key=%s start=%d", record.key, record.start)
            return parts
        raise IndexUnavailable(f"{record.key!r}: the part's commit failed and it is not recorded") from unknown

    async def _already_complete(
        self,
        path: str,
        size: int,
        digest: str,
        body: AsyncIterable[bytes],
        span: ByteSpan,
        part_digest: str | None,
    ) -> PartOutcome:
        if size != span.total:
            raise Conflict(f"{path!r} is complete with {size} bytes, the part says {span.total}")
        checker = BodyChecker(size=span.size, expected_digest=part_digest)
        async for chunk in body:
            checker.update(chunk)
        return _complete(path, size, digest, span, checker.finish().digest)

    async def _assemble(self, change: Change, key: BlockKey, parts: list[PartRecord], total: int) -> str:
        """Concatenate the parts into a staged version and commit it (the key is held)."""
        path = key.path
        upload = one_upload(parts) if self._store.uploads else None
        try:
            if upload is not None:  # the parts become the object: no copy
                regions = [Region(p.start, p.end, p.digest) for p in parts]
                try:
                    staged = await self._store.stage_upload(upload, path, regions, total, algorithm=_algorithm(parts))
                except (DigestMismatch, SizeMismatch) as exc:
                    log.error("upload is corrupt key=%s: %s", path, exc)
                    raise Conflict(f"stored parts are corrupt ({exc}); re-send them") from exc
            else:
                staged = await self._versions.stage(path, self._concat(parts), size=total, algorithm=_algorithm(parts))
        except Conflict:  # a stored part is corrupt: drop them all, the writers send them again next time
            await self.drop(path, parts)
            raise
        except BlockNotFound:
            record = await self._index.get(path)
            if record is not None and record.size == total:  # another replica assembled it and dropped the parts
                return record.digest
            raise
        await change.commit(key, staged)
        try:
            await self.drop(path, parts)
        except IndexUnavailable as exc:  # the object stands: its parts go with the idle uploads' sweep
            log.warning("assembled key=%s, its parts stay for the sweep: %s", path, exc)
        log.info("assembled key=%s parts=%d size=%d", path, len(parts), total)
        return staged.meta.digest

    async def _concat(self, parts: list[PartRecord]) -> AsyncIterator[bytes]:
        for part in parts:
            checker = BodyChecker(size=part.end - part.start, expected_digest=part.digest)
            at = part.start if in_upload(part) else 0
            async with await self._store.open(part.store_key) as reader:
                try:
                    async for chunk in reader.chunks(start=at, end=at + part.end - part.start):
                        checker.update(chunk)
                        yield chunk if isinstance(chunk, bytes) else bytes(chunk)  # a store's body is bytes
                    checker.finish()
                except DigestMismatch as exc:
                    log.error("stored part is corrupt key=%s start=%d: %s", part.key, part.start, exc)
                    raise Conflict(f"stored part at byte {part.start} is corrupt; re-send it") from exc

    async def drop(self, path: str, parts: list[PartRecord] | None = None) -> int:
        """Forget ``parts`` of ``path`` (all of its parts if None): rows, then data; how many rows went. Only the
        parts given: one recorded since they were read stays, with its data."""
        parts = await self._index.get_parts(path) if parts is None else parts
        if not parts:
            return 0
        removed = await self._index.delete_parts(path, parts)
        if removed:
            with contextlib.suppress(InvalidKey):
                self._versions.parts_moved(parse_block_key(path).namespace, -sum(p.end - p.start for p in parts))
        stored = {part.store_key for part in parts}  # in place: one upload file holds them all
        await asyncio.gather(*(self._store.delete(store_key) for store_key in stored), return_exceptions=True)
        return removed


def _algorithm(parts: list[PartRecord]) -> str:
    """The checksum algorithm of an object assembled from ``parts``: sha256 if its writers sent every part with one
    (they asked for a cryptographic digest), kvgate's default otherwise."""
    return SHA256 if all(algorithm_of(p.digest) == SHA256 for p in parts) else DEFAULT_ALGORITHM
