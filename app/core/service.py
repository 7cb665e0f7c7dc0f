"""BlockService: the request operations (put, put_part, open, head, delete, lookup, namespace configs), each a
short story told with the pieces that own their parts: ``Versions`` (a key's life under its lock,
app/core/versions.py), ``PartAssembler`` (multi-part objects), the admission hook of capacity, and the index's
read paths. It keeps no state of its own beyond counters and a small cache of namespace layouts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from app.core.arrivals import RECHECK_S
from app.core.event_sink import NO_EVENTS, EventSink, PutInProgress
from app.core.memo import NamespaceMemo
from app.core.parts import PartAssembler, PartOutcome
from app.core.reads import OpenBlock
from app.core.versions import Versions
from app.errors import (
    BlockNotFound,
    Conflict,
    InvalidRequest,
    LayoutMismatch,
    NamespaceNotFound,
    PreconditionFailed,
    VersionMismatch,
)
from app.index import ABSENT, ANY, Index
from app.storage import BlockStore
from app.storage.base import BodyChecker, Version
from contract.keys import (
    BlockKey,
    InvalidKey,
    check_block_paths,
    check_namespace_fields,
    config_path,
    parse_namespace,
)
from contract.wire import BlockMetaValue, ByteSpan

log = logging.getLogger("kvgate.service")

MAX_CONFIG_BYTES = 64 * 1024
"""The largest namespace config (a run's FileMapper fields are a few hundred bytes to a few KiB)."""
OPEN_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class PutResult:
    meta: Version
    created: bool


@dataclass(slots=True)
class Counters:
    """In-process counters of block reads, for /v1/stats and /metrics (GET and HEAD; lookups are not reads)."""

    hits: int = 0
    misses: int = 0


class Admission(Protocol):
    """Capacity (app/core/capacity.py): room for a write, or 507."""

    @property
    def bounded(self) -> bool:
        """A capacity bound or a namespace quota is set: ``admit`` needs the size a write replaces."""

    async def admit(self, *, namespace: str, size: int, replacing: int, whole: int | None = None) -> None:
        """Reserve room for ``size`` bytes (replacing ``replacing``), evicting if need be, or raise 507."""

    def release(self, *, namespace: str, size: int) -> None:
        """Drop the reservation made by ``admit`` (the write finished, stored or failed)."""


class Repair(Protocol):
    """Upkeep's repair of one key (app/core/upkeep.py), for a reader that found no version its row names."""

    async def repair(self, key: BlockKey) -> object: ...


class BlockService:
    def __init__(
        self,
        *,
        versions: Versions,
        parts: PartAssembler,
        admission: Admission,
        repair: Repair,
        store: BlockStore,
        index: Index,
        events: EventSink = NO_EVENTS,
    ) -> None:
        self._versions = versions
        self._events = events
        self._parts = parts
        self._admission = admission
        self._repair = repair
        self._store = store
        self._index = index
        self.counters = Counters()
        self._layouts: NamespaceMemo[int] = NamespaceMemo()
        """Namespace -> the block size its config records (0: none)."""

    # -- writes -----------------------------------------------------------------------------------------------

    async def put(
        self,
        key: BlockKey,
        body: AsyncIterable[bytes],
        *,
        size: int,
        digest: str | None,
        create_only: bool,
        meta: BlockMetaValue | None = None,
    ) -> PutResult:
        """``meta``: what the writer said of the block (``X-KVGate-Block-Meta``), for the KV events."""
        async with self._events.writing(key.path, meta) as put:  # its children's events wait for it
            return await self._put(key, body, size=size, digest=digest, create_only=create_only, put=put)

    async def _put(
        self,
        key: BlockKey,
        body: AsyncIterable[bytes],
        *,
        size: int,
        digest: str | None,
        create_only: bool,
        put: PutInProgress | None,
    ) -> PutResult:
        path = key.path
        await self._check_layout(key, size)
        # The row now is needed only to refuse a create-only PUT before its body is read, and for a bound's room;
        # otherwise the commit reads it anyway (and writes nothing when it already holds these bytes), so a new
        # key's PUT makes no index read of its own: only the cache is asked, for an identical re-PUT.
        need_row = create_only or self._admission.bounded
        existing = await self._versions.read(path) if need_row else self._versions.cached(path)
        if existing is not None and create_only:
            raise PreconditionFailed(f"{path!r} is present (If-None-Match: *)")
        if existing is not None and digest is not None and digest == existing.digest and size == existing.size:
            checker = BodyChecker(size=size, expected_digest=digest)  # identical re-put: verify, write nothing
            async for chunk in body:
                checker.update(chunk)
            checker.finish()
            return PutResult(meta=existing, created=False)
        await self._admission.admit(namespace=key.namespace, size=size, replacing=existing.size if existing else 0)
        try:
            staged = await self._versions.stage(path, body, size=size, expected_digest=digest)

            async def commit() -> PutResult:
                async with self._versions.change(path, put=put) as change:
                    done = await change.commit(key, staged, expect=ABSENT if create_only else ANY)
                if create_only and not done.written:
                    raise PreconditionFailed(f"{path!r} is present (If-None-Match: *)")
                return PutResult(meta=done.meta, created=done.old is None and done.written)

            # the change runs to its end even if the client goes away: a half-made change is never left behind
            return await asyncio.shield(commit())
        finally:
            self._admission.release(namespace=key.namespace, size=size)

    async def put_part(
        self,
        key: BlockKey,
        body: AsyncIterable[bytes],
        *,
        span: ByteSpan,
        part_digest: str | None,
        create_only: bool,
        meta: BlockMetaValue | None = None,
    ) -> PartOutcome:
        """Store one byte range of a multi-part object; the object is published when the parts cover it."""
        await self._check_layout(key, span.total)
        if create_only and await self._versions.read(key.path) is not None:
            raise PreconditionFailed(f"{key.path!r} is present (If-None-Match: *)")
        await self._admission.admit(namespace=key.namespace, size=span.size, replacing=0, whole=span.total)
        try:
            async with self._events.writing(key.path, meta) as put:
                return await self._parts.put_part(key, body, span=span, part_digest=part_digest, put=put)
        finally:
            self._admission.release(namespace=key.namespace, size=span.size)

    async def delete(self, key: BlockKey) -> None:
        """Remove the key's version (row, then data, durably), its incomplete upload, or data no row describes."""
        path = key.path

        async def run() -> bool:
            async with self._versions.change(path) as change:
                old = await change.remove()
                dropped = await self._parts.drop(path)
                orphan = False if old is not None else await self._store.delete(path)
                return old is not None or orphan or dropped > 0

        if not await asyncio.shield(run()):
            raise BlockNotFound(path)

    # -- reads ------------------------------------------------------------------------------------------------

    async def check(self) -> None:
        """Raise unless the store and the index both answer (readiness)."""
        await self._store.check()
        await self._index.check()

    async def head(self, key: BlockKey) -> Version:
        meta = await self._versions.read(key.path)
        if meta is None:
            self.counters.misses += 1
            raise BlockNotFound(key.path)
        self.counters.hits += 1
        return meta

    def cached(self, path: str) -> Version | None:
        """The row the metadata cache holds for ``path`` as :meth:`head` would serve it (None: not cached; only
        block keys are ever cached), nothing counted. Synchronous: the HEAD lane answers from it inside the HTTP
        protocol, and counts its hit in ``counters``."""
        return self._versions.cached(path)

    def open_now(self, path: str, meta: Version) -> int | None:
        """A descriptor of the file of version ``meta`` of ``path`` (the row :meth:`cached` gave), opened here and
        now, without waiting (the GET lane sends the file with ``sendfile``); None when the store has no such open,
        or the file is not that version or not all in the page cache (:meth:`open` then serves it, with its
        repairs). Counted as :meth:`open` counts a hit, the access time included."""
        if meta.stamp is None:
            return None
        fd = self._store.open_now(path, stamp=meta.stamp, size=meta.size)
        if fd is None:
            return None
        self.counters.hits += 1
        self._index.touch(path)
        return fd

    async def open(self, key: BlockKey) -> OpenBlock:
        """The version the index names, opened: body, size and digest of one version, always together."""
        path = key.path
        for attempt in range(OPEN_ATTEMPTS + 1):
            if attempt == OPEN_ATTEMPTS:
                # no change in flight, and the data is still not the version its row names: repair, then a last look
                log.warning("stored data is not its row's version key=%s: repairing", path)
                await self._repair.repair(key)
            meta = await self._versions.read(path, fresh=attempt > 0)
            if meta is None:
                break
            try:
                reader = await self._store.open(path, stamp=meta.stamp)
            except (VersionMismatch, BlockNotFound):
                await self._versions.settle(path)  # a change of this key in flight: read after it
                continue
            if reader.size != meta.size:  # a row without a stamp (written before 0003) that no longer fits
                await reader.aclose()
                await self._versions.settle(path)
                continue
            self.counters.hits += 1
            self._index.touch(path)
            return OpenBlock(meta, reader)
        self.counters.misses += 1
        raise BlockNotFound(path)

    async def lookup(
        self, paths: list[str], *, wait_s: float = 0.0, min_prefix: int | None = None
    ) -> tuple[int, list[tuple[int, str] | None]]:
        """Length of the longest present prefix of ``paths``, and each path's (size, digest) (None: absent).

        ``wait_s``: until the prefix is at least ``min_prefix`` keys (None: all of them), look again each time
        its first absent key is committed in this process (or every ``RECHECK_S``, for other processes' commits),
        for at most ``wait_s``; then answer what is present."""
        check_block_paths(paths)  # InvalidKey: a 400; a path that parses is its own canonical form
        want = len(paths) if min_prefix is None else min(min_prefix, len(paths))
        deadline = asyncio.get_running_loop().time() + wait_s
        arrivals = self._versions.arrivals
        while True:
            since = arrivals.commits
            found = await self._index.sizes_many(paths)
            slots = [found.get(p) for p in paths]
            prefix = 0
            for slot in slots:
                if slot is None:
                    break
                prefix += 1
            left = deadline - asyncio.get_running_loop().time()
            if prefix >= want or left <= 0:
                return prefix, slots
            await arrivals.wait(paths[prefix], since=since, timeout_s=min(left, RECHECK_S))

    # -- namespaces -------------------------------------------------------------------------------------------

    async def _check_layout(self, key: BlockKey, size: int) -> None:
        """422 if the namespace's recorded layout gives its blocks another byte size."""
        # a config stored in another process is found (app/core/memo.py)
        expected = await self._layouts.fetch(key.namespace, self._recorded_block_bytes)
        if expected and size != expected:
            raise LayoutMismatch(
                f"namespace {key.namespace!r} records blocks of {expected} bytes (block_bytes); this one has {size}"
            )

    async def _recorded_block_bytes(self, namespace: str) -> int | None:
        """The block size the namespace's config records; 0: a config that records none (for good); None: no config
        (yet)."""
        record = await self._index.get_namespace(namespace)
        if record is None:
            return None
        found = record.fields.get("block_bytes")
        return found if isinstance(found, int) else 0

    def forget_layout(self, namespace: str) -> None:
        """A namespace's config was removed (purge): read its layout again next time."""
        self._layouts.drop(namespace)

    async def put_config(self, namespace: str, fields: dict[str, Any], raw: bytes) -> bool:
        """Store a namespace's fields (checked against its name); True if new. ``raw`` is stored verbatim."""
        parse_namespace(namespace)  # InvalidKey: a 400
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
        current = await self._index.get_namespace(namespace)
        if current is not None and current.fields != fields:
            raise Conflict(f"namespace {namespace!r} holds other fields")

        async def body() -> AsyncIterator[bytes]:
            yield raw

        await self._store.put(config_path(namespace), body(), size=len(raw))
        self._layouts.drop(namespace)
        created = await self._index.put_namespace(name=namespace, fields=fields)
        self._events.namespace_config(namespace, fields)  # the model name in the events' topic
        return created

    async def get_config(self, namespace: str) -> dict[str, Any]:
        parse_namespace(namespace)  # InvalidKey: a 400
        record = await self._index.get_namespace(namespace)
        if record is None:
            raise NamespaceNotFound(namespace)
        return record.fields
