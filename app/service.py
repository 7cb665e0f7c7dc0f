"""BlockService: the one place that orders "data written, then index updated" and decides what a client sees."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from app.errors import (
    BlockNotFound,
    Conflict,
    DigestMismatch,
    IndexUnavailable,
    InvalidRequest,
    KVGateError,
    NamespaceNotFound,
    PreconditionFailed,
    RangeNotSatisfiable,
    SizeMismatch,
)
from app.index import BlockRecord, Index
from app.parts import ByteSpan, PartAssembler, PartOutcome
from app.storage import BlockStore, ObjectReader
from app.storage.base import BodyChecker
from connector.protocol import (
    BlockKey,
    InvalidKey,
    check_namespace_fields,
    config_path,
    parse_block_key,
    parse_namespace,
)

log = logging.getLogger("kvgate.service")


@dataclass(frozen=True, slots=True)
class BlockMeta:
    key: str
    size: int
    digest: str


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
    """Capacity accounting and admission (app/eviction.py): told of every stored and removed block."""

    async def admit(self, *, namespace: str, size: int, replacing: int) -> None:
        """Reserve room for ``size`` bytes (replacing ``replacing``), evicting if need be, or raise 507."""

    def release(self, *, namespace: str, size: int) -> None:
        """Drop the reservation made by ``admit`` (the PUT finished, stored or failed)."""

    def stored(self, *, namespace: str, size: int, replaced: int | None) -> None:
        """A block of ``size`` bytes is now recorded (``replaced``: the size it replaced; None: it is new)."""

    def removed(self, *, namespace: str, size: int) -> None: ...


class MetaCache:
    """Bounded LRU of block metadata, optionally with a time-to-live (several gateways sharing one index)."""

    def __init__(self, *, entries: int, ttl_s: float | None) -> None:
        self._entries = entries
        self._ttl = ttl_s
        self._data: OrderedDict[str, tuple[BlockMeta, float]] = OrderedDict()

    def get(self, key: str) -> BlockMeta | None:
        item = self._data.get(key)
        if item is None:
            return None
        meta, stamp = item
        if self._ttl is not None and time.monotonic() - stamp > self._ttl:
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return meta

    def put(self, meta: BlockMeta) -> None:
        if self._entries == 0 or self._ttl == 0:
            return
        self._data[meta.key] = (meta, time.monotonic())
        self._data.move_to_end(meta.key)
        while len(self._data) > self._entries:
            self._data.popitem(last=False)

    def drop(self, key: str) -> None:
        self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()


def parse_key(path: str) -> BlockKey:
    try:
        return parse_block_key(path)
    except InvalidKey as exc:
        raise InvalidRequest(str(exc)) from exc


def resolve_range(spec: str | None, size: int) -> tuple[int, int] | None:
    """Parse a single ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range into half-open ``[start, end)``."""
    if spec is None:
        return None
    unit, _, ranges = spec.strip().partition("=")
    if unit.strip().lower() != "bytes" or not ranges or "," in ranges:
        raise InvalidRequest("only a single 'bytes=a-b' range is supported")
    first, dash, last = ranges.strip().partition("-")
    if not dash or not (first.isdigit() or last.isdigit()) or (first and not first.isdigit()):
        raise InvalidRequest(f"malformed range {spec!r}")
    if last and not last.isdigit():
        raise InvalidRequest(f"malformed range {spec!r}")
    if not first:  # suffix range: the last n bytes
        n = int(last)
        if n == 0:
            raise RangeNotSatisfiable("empty suffix range", size=size)
        return max(0, size - n), size
    start = int(first)
    end = min(size, int(last) + 1) if last else size
    if start >= size or (last and int(last) < start):
        raise RangeNotSatisfiable(f"range {spec!r} outside 0-{size - 1}", size=size)
    return start, end


class OpenBlock:
    """A block opened for reading: metadata plus a reader that the response closes."""

    def __init__(self, meta: BlockMeta, reader: ObjectReader) -> None:
        self.meta = meta
        self.reader = reader

    async def stream(self, start: int, end: int) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.reader.chunks(start=start, end=end):
                yield chunk
        finally:
            await self.reader.aclose()


async def read_range_verified(block: OpenBlock, start: int, end: int) -> tuple[bytes, str]:
    """The bytes ``[start, end)`` and their sha256, after checking the WHOLE object against the index's digest.

    A reader at another TP size asks for a byte range, which the ETag (the whole object's digest) cannot vouch for;
    so the gateway reads the object once, checks it, and vouches for the range itself. A mismatch is corruption at
    rest: BlockNotFound (a miss, which the engine recomputes), never the bytes.
    """
    checker = BodyChecker(size=block.meta.size, expected_digest=block.meta.digest)
    chunks: list[bytes] = []
    pos = 0
    try:
        async for chunk in block.reader.chunks(start=0, end=block.meta.size):
            checker.update(chunk)
            lo, hi = max(start, pos), min(end, pos + len(chunk))
            if lo < hi:
                chunks.append(chunk[lo - pos : hi - pos])
            pos += len(chunk)
        checker.finish()
    except (DigestMismatch, SizeMismatch) as exc:
        log.error("corrupt block key=%s: %s", block.meta.key, exc)
        raise BlockNotFound(block.meta.key) from exc
    finally:
        await block.reader.aclose()
    data = b"".join(chunks)
    return data, hashlib.sha256(data).hexdigest()


class BlockService:
    def __init__(self, *, store: BlockStore, index: Index, cache: MetaCache) -> None:
        self.store = store
        self.index = index
        self.cache = cache
        self.parts = PartAssembler(store=store, index=index)
        self.counters = Counters()
        self.capacity: CapacityHook | None = None
        """Set by create_app when a capacity bound is configured."""
        self.writing: set[str] = set()
        """Keys with a PUT in flight: eviction skips them (it would unlink the new data under the new row)."""

    async def _meta(self, key: str) -> BlockMeta | None:
        meta = self.cache.get(key)
        if meta is not None:
            return meta
        record = await self.index.get(key)
        if record is None:
            return None
        meta = BlockMeta(key=record.key, size=record.size, digest=record.digest)
        self.cache.put(meta)
        return meta

    # -- blocks ----------------------------------------------------------------------------------------------

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
        existing = await self.index.get(path)
        if existing is not None and create_only:
            raise PreconditionFailed(f"{path!r} is present (If-None-Match: *)")
        if existing is not None and digest is not None and digest.lower() == existing.digest and size == existing.size:
            # Identical re-put: verify the body as it drains, write nothing.
            checker = BodyChecker(size=size, expected_digest=digest)
            async for chunk in body:
                checker.update(chunk)
            checker.finish()
            return PutResult(meta=BlockMeta(key=path, size=size, digest=existing.digest), created=False)
        self.writing.add(path)  # before admission: eviction must not pick the block this PUT replaces
        admitted = False
        try:
            if self.capacity is not None:
                replacing = existing.size if existing else 0
                await self.capacity.admit(namespace=key.namespace, size=size, replacing=replacing)
                admitted = True
            stored = await self.store.put(path, body, size=size, expected_digest=digest)
            self.cache.drop(path)
            try:
                await self.index.upsert_block(
                    key=path,
                    namespace=key.namespace,
                    rank=key.rank,
                    group=key.group,
                    size=stored.size,
                    digest=stored.digest,
                )
            except IndexUnavailable:
                if existing is not None and existing.digest != stored.digest:
                    # The old row would vouch for the new bytes under the old ETag: take the bytes away instead
                    # (a miss, which the client recomputes), never serve bytes the index does not describe.
                    with contextlib.suppress(KVGateError):
                        await self.store.delete(path)
                raise
            if self.capacity is not None:
                replaced = existing.size if existing else None
                self.capacity.stored(namespace=key.namespace, size=stored.size, replaced=replaced)
        finally:
            self.writing.discard(path)
            if admitted and self.capacity is not None:
                self.capacity.release(namespace=key.namespace, size=size)
        meta = BlockMeta(key=path, size=stored.size, digest=stored.digest)
        self.cache.put(meta)
        return PutResult(meta=meta, created=existing is None)

    async def head(self, key: BlockKey) -> BlockMeta:
        meta = await self._meta(key.path)
        if meta is None:
            self.counters.misses += 1
            raise BlockNotFound(key.path)
        self.counters.hits += 1
        return meta

    async def open(self, key: BlockKey) -> OpenBlock:
        path = key.path
        meta = await self._meta(path)
        if meta is None:
            self.counters.misses += 1
            raise BlockNotFound(path)
        try:
            reader = await self.store.open(path)
        except BlockNotFound:
            self.cache.drop(path)  # deleted behind our back (another replica, an operator)
            self.counters.misses += 1
            raise
        if reader.size != meta.size:
            await reader.aclose()
            self.cache.drop(path)
            log.error("size mismatch key=%s index=%s store=%s", path, meta.size, reader.size)
            self.counters.misses += 1
            raise BlockNotFound(path)
        self.counters.hits += 1
        self.index.touch(path)
        return OpenBlock(meta, reader)

    async def delete(self, key: BlockKey) -> None:
        path = key.path
        self.cache.drop(path)
        record = await self.index.get(path) if self.capacity is not None else None
        removed_data = await self.store.delete(path)
        removed_rows = await self.index.delete_blocks([path])
        if self.capacity is not None and record is not None and removed_rows:
            self.capacity.removed(namespace=record.namespace, size=record.size)
        await self.parts.drop(path)
        if not removed_data and not removed_rows:
            raise BlockNotFound(path)

    async def put_part(
        self, key: BlockKey, body: AsyncIterable[bytes], *, span: ByteSpan, part_digest: str | None, create_only: bool
    ) -> PartOutcome:
        """Store one byte range of a multi-part object; the object is published when the parts cover it."""
        if create_only and await self._meta(key.path) is not None:
            raise PreconditionFailed(f"{key.path!r} is present (If-None-Match: *)")
        outcome = await self.parts.put_part(key, body, span=span, part_digest=part_digest)
        if outcome.complete:
            self.cache.drop(key.path)
            if outcome.created and self.capacity is not None:
                self.capacity.stored(namespace=key.namespace, size=span.total, replaced=None)
        return outcome

    async def lookup(self, paths: list[str]) -> tuple[int, list[BlockRecord | None]]:
        """Length of the longest present prefix of ``paths``, and each path's record (None: absent)."""
        keys = [parse_key(p).path for p in paths]
        found = await self.index.get_many(keys)
        slots = [found.get(k) for k in keys]
        prefix = 0
        for slot in slots:
            if slot is None:
                break
            prefix += 1
        return prefix, slots

    # -- namespaces ------------------------------------------------------------------------------------------

    async def put_config(self, namespace: str, fields: dict[str, Any], raw: bytes) -> bool:
        """Store a namespace's fields (checked against its name); True if new. ``raw`` is stored verbatim."""
        try:
            parse_namespace(namespace)
        except InvalidKey as exc:
            raise InvalidRequest(str(exc)) from exc
        try:
            check_namespace_fields(namespace, fields)
        except InvalidKey as exc:
            raise Conflict(str(exc)) from exc
        current = await self.index.get_namespace(namespace)
        if current is not None and current.fields != fields:
            raise Conflict(f"namespace {namespace!r} holds other fields")

        async def body() -> AsyncIterator[bytes]:
            yield raw

        await self.store.put(config_path(namespace), body(), size=len(raw))
        return await self.index.put_namespace(name=namespace, fields=fields)

    async def get_config(self, namespace: str) -> dict[str, Any]:
        try:
            parse_namespace(namespace)
        except InvalidKey as exc:
            raise InvalidRequest(str(exc)) from exc
        record = await self.index.get_namespace(namespace)
        if record is None:
            raise NamespaceNotFound(namespace)
        return record.fields
