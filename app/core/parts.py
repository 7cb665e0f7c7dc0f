"""Multi-part objects: each TP rank PUTs its byte range of a canonical block with ``Content-Range``.

A part's bytes go to the store under ``_parts/<key>/<start>-<end>.<uuid>`` (a key the block grammar can never
produce: block namespaces never start with ``_parts/``), and a row goes to the ``parts`` table, create-only on
``(key, start)``. The object stays invisible (no ``blocks`` row: HEAD/GET 404, lookup miss) until the parts cover
``[0, total)``; the PUT that completes the cover assembles the object by streaming the parts, in order, through
a staged version (which computes the digest), commits it through BlockService (row, then rename), then drops
the parts. Stored part bytes count against capacity until then.

Concurrency: part data is written outside any lock (each write has its own store key, so two writers never
clobber each other); the bookkeeping and the assembly run under BlockService's lock of the key. Across gateway replicas
sharing one index a second assembler produces the same bytes (the concatenation is deterministic), and one
that finds the parts gone while reading checks that the object was published by the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from app.core.keystate import KeyLocks
from app.errors import BlockNotFound, Conflict, DigestMismatch, InvalidRequest, RangeNotSatisfiable
from app.index import Index, PartRecord
from app.storage import BlockStore
from app.storage.base import BodyChecker, Staged
from connector import wire
from connector.protocol import BlockKey, InvalidKey, parse_block_key
from connector.wire import ByteSpan as ByteSpan  # its home before connector.wire

log = logging.getLogger("kvgate.parts")

PARTS_PREFIX = "_parts/"
"""Store prefix of part data; reconcile/adopt must skip it (never a block key)."""


def parse_content_range(value: str) -> ByteSpan:
    """``bytes a-b/total`` (inclusive ``b``) -> ByteSpan (connector.wire); 400 if malformed, 416 past ``total``."""
    try:
        return wire.parse_content_range(value)
    except wire.RangeNotSatisfiable as exc:
        raise RangeNotSatisfiable(str(exc), size=exc.size) from exc
    except wire.MalformedHeader as exc:
        raise InvalidRequest(str(exc)) from exc


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
    """The object's sha256 once complete."""


def _check_against(parts: list[PartRecord], span: ByteSpan, digest: str | None) -> PartRecord | None:
    """The identical part already recorded (or None); Conflict on another total or an overlapping range."""
    for p in parts:
        if p.total != span.total:
            raise Conflict(f"part says the object has {span.total} bytes, an earlier part said {p.total}")
        if p.start == span.start and p.end == span.end and (digest is None or digest == p.digest):
            return p
        if p.start < span.end and span.start < p.end:
            raise Conflict(f"bytes {span.start}-{span.end - 1} overlap the stored part {p.start}-{p.end - 1}")
    return None


def covers(parts: list[PartRecord], total: int) -> bool:
    """Do ``parts`` (ordered by start, non-overlapping) cover ``[0, total)`` exactly?"""
    pos = 0
    for p in parts:
        if p.start != pos:
            return False
        pos = p.end
    return pos == total


class Commit(Protocol):
    """BlockService's commit of a staged version, called with the key's lock held."""

    async def __call__(self, key: BlockKey, staged: Staged, *, create_only: bool) -> Any: ...


class PartAssembler:
    """Part bookkeeping and assembly; the key's changes are ordered by BlockService's lock of that key."""

    def __init__(
        self,
        *,
        store: BlockStore,
        index: Index,
        locks: KeyLocks,
        commit: Commit,
        usage: Callable[[str, int, int], None],
    ) -> None:
        self.store = store
        self.index = index
        self._lock = locks
        self._commit = commit
        self._usage = usage

    async def put_part(
        self, key: BlockKey, body: AsyncIterable[bytes], *, span: ByteSpan, part_digest: str | None
    ) -> PartOutcome:
        path = key.path
        existing, parts = await self.index.part_state(path)
        if existing is not None:
            return await self._already_complete(path, existing.size, existing.digest, body, span, part_digest)
        _check_against(parts, span, part_digest)  # fail fast, before any byte is kept
        store_key = f"{PARTS_PREFIX}{path}/{span.start}-{span.end}.{uuid.uuid4().hex}"
        stored = await self.store.put(store_key, body, size=span.size, expected_digest=part_digest)
        keep = False
        try:
            async with self._lock(path):
                existing, parts = await self.index.part_state(path)
                if existing is not None:  # completed by another writer while our bytes streamed
                    return PartOutcome(path, span, stored.digest, True, False, existing.digest)
                same = _check_against(parts, span, stored.digest)
                if same is None:
                    record = PartRecord(
                        key=path,
                        start=span.start,
                        end=span.end,
                        total=span.total,
                        digest=stored.digest,
                        store_key=store_key,
                    )
                    recorded = await self.index.add_part(record)
                    if recorded is None:  # another replica recorded this start first
                        raise Conflict(f"a part starting at byte {span.start} was recorded concurrently")
                    keep = True
                    self._usage(key.namespace, 0, span.size)
                    parts = recorded
                if not covers(parts, span.total):
                    return PartOutcome(path, span, stored.digest, False, same is None, None)
                digest = await self._assemble(key, parts, span.total)
                return PartOutcome(path, span, stored.digest, True, same is None, digest)
        finally:
            if not keep:
                with contextlib.suppress(Exception):
                    await self.store.delete(store_key)

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
        meta = checker.finish()
        return PartOutcome(path, span, meta.digest, True, False, digest)

    async def _assemble(self, key: BlockKey, parts: list[PartRecord], total: int) -> str:
        """Concatenate the parts into a staged version and commit it (the caller holds the key's lock)."""
        path = key.path
        try:
            staged = await self.store.stage(path, self._concat(parts), size=total)
        except Conflict:  # a stored part is corrupt: drop them all, the writers send them again next time
            await self.drop(path, parts)
            raise
        except BlockNotFound:
            record = await self.index.get(path)
            if record is not None and record.size == total:  # another replica assembled it and dropped the parts
                return record.digest
            raise
        await self._commit(key, staged, create_only=False)
        await self.drop(path, parts)
        log.info("assembled key=%s parts=%d size=%d", path, len(parts), total)
        return staged.meta.digest

    async def _concat(self, parts: list[PartRecord]) -> AsyncIterator[bytes]:
        for part in parts:
            checker = BodyChecker(size=part.end - part.start, expected_digest=part.digest)
            async with await self.store.open(part.store_key) as reader:
                try:
                    async for chunk in reader.chunks(start=0, end=reader.size):
                        checker.update(chunk)
                        yield chunk
                    checker.finish()
                except DigestMismatch as exc:
                    log.error("stored part is corrupt key=%s start=%d: %s", part.key, part.start, exc)
                    raise Conflict(f"stored part at byte {part.start} is corrupt; re-send it") from exc

    async def drop(self, path: str, parts: list[PartRecord] | None = None) -> int:
        """Forget the parts of ``path`` (rows, then data); how many rows there were."""
        parts = await self.index.get_parts(path) if parts is None else parts
        if not parts:
            return 0
        removed = await self.index.delete_parts(path)
        if removed:
            with contextlib.suppress(InvalidKey):
                self._usage(parse_block_key(path).namespace, 0, -sum(p.end - p.start for p in parts))
        await asyncio.gather(*(self.store.delete(part.store_key) for part in parts), return_exceptions=True)
        return removed
