"""Capacity: usage accounting, admission of PUTs (507) and LRU eviction between two watermarks.

Usage is an in-process running total of (blocks, bytes), overall and per namespace, loaded from the index at
start-up (after reconcile), adjusted on every put/delete/eviction and re-read from the index periodically (the
index is the truth; the total only keeps the request path free of aggregate queries).

Eviction order is **data first, then the row**, and the row is deleted only if it was not rewritten meanwhile
(its ``created_at`` is unchanged):

- a crash between the two leaves a row without data, which the next reconcile drops: the eviction completes.
  The other order would leave data without a row, which reconcile *adopts*: the eviction would be undone;
- a GET already streaming keeps its open file descriptor, which reads on after the unlink (S3 streams an object
  that is deleted mid-read to the end too); a GET that opens after the unlink is a clean 404 miss;
- a block that a PUT is writing is never a candidate (BlockService.writing), and if a PUT slips in between the
  choice and the unlink, the row check sees the new ``created_at``, keeps the row and repairs the rare case
  where the new data was unlinked (the row goes too: a miss, never a wrong answer).

Candidates are least recently used by the index's ``last_access`` (created_at, then key as tie-breaks); pending
touches are flushed first so that reads in the last flush interval count. HEAD and lookup do not touch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.config import Settings
from app.errors import InsufficientStorage, KVGateError
from app.index import Candidate, NamespaceUsage
from app.service import BlockService

log = logging.getLogger("kvgate.eviction")

DELETE_CONCURRENCY = 16


@dataclass(slots=True)
class Usage:
    """Running totals of stored blocks, overall and per namespace."""

    blocks: int = 0
    bytes: int = 0
    by_namespace: dict[str, list[int]] = field(default_factory=dict)

    def reset(self, rows: Sequence[NamespaceUsage]) -> None:
        self.by_namespace = {r.namespace: [r.blocks, r.bytes] for r in rows}
        self.blocks = sum(r.blocks for r in rows)
        self.bytes = sum(r.bytes for r in rows)

    def add(self, *, namespace: str, blocks: int, nbytes: int) -> None:
        self.blocks += blocks
        self.bytes += nbytes
        slot = self.by_namespace.setdefault(namespace, [0, 0])
        slot[0] += blocks
        slot[1] += nbytes
        if slot[0] <= 0:
            del self.by_namespace[namespace]

    def of(self, namespace: str) -> tuple[int, int]:
        slot = self.by_namespace.get(namespace)
        return (slot[0], slot[1]) if slot else (0, 0)


class Capacity:
    """Implements BlockService's CapacityHook, and runs the background eviction task."""

    def __init__(self, *, service: BlockService, settings: Settings) -> None:
        self.service = service
        self.max_bytes = settings.max_bytes
        self.quota = settings.namespace_quota_bytes
        self.high = settings.high_watermark
        self.low = settings.low_watermark
        self.interval_s = settings.eviction_interval_s
        self.resync_s = settings.usage_resync_interval_s
        self.batch = settings.eviction_batch
        self.usage = Usage()
        self.reserved = 0
        self.reserved_by_ns: dict[str, int] = {}
        self.evictions = 0
        self.evicted_bytes = 0
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._synced_at = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def load(self) -> None:
        """Re-read usage from the index (exact: the index is the truth)."""
        self.usage.reset(await self.service.index.namespace_usage())
        self._synced_at = time.monotonic()

    async def start(self) -> None:
        await self.load()
        self._task = asyncio.create_task(self._loop(), name="kvgate-eviction")
        if self._over_any():
            self._kick.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the hook --------------------------------------------------------------------------------------------

    async def admit(self, *, namespace: str, size: int, replacing: int) -> None:
        if self.max_bytes is not None and size > self.max_bytes:
            raise InsufficientStorage(f"a {size}-byte block can never fit in max_bytes={self.max_bytes}")
        if self.quota is not None and size > self.quota:
            raise InsufficientStorage(f"a {size}-byte block can never fit in the namespace quota {self.quota}")
        if self.max_bytes is not None:
            room = self.max_bytes - self.reserved - size + replacing
            if self.usage.bytes > room:
                await self.evict(target_bytes=min(int(self.max_bytes * self.low), room))
                if self.usage.bytes > room:
                    raise InsufficientStorage(f"no room for {size} bytes within max_bytes={self.max_bytes}")
        if self.quota is not None:
            room = self.quota - self.reserved_by_ns.get(namespace, 0) - size + replacing
            if self.usage.of(namespace)[1] > room:
                await self.evict(target_bytes=min(int(self.quota * self.low), room), namespace=namespace)
                if self.usage.of(namespace)[1] > room:
                    raise InsufficientStorage(f"no room for {size} bytes within namespace quota {self.quota}")
        self.reserved += size
        self.reserved_by_ns[namespace] = self.reserved_by_ns.get(namespace, 0) + size

    def release(self, *, namespace: str, size: int) -> None:
        self.reserved -= size
        held = self.reserved_by_ns.get(namespace, 0) - size
        if held > 0:
            self.reserved_by_ns[namespace] = held
        else:
            self.reserved_by_ns.pop(namespace, None)

    def stored(self, *, namespace: str, size: int, replaced: int | None) -> None:
        if replaced is None:
            self.usage.add(namespace=namespace, blocks=1, nbytes=size)
        else:
            self.usage.add(namespace=namespace, blocks=0, nbytes=size - replaced)
        if self._over(namespace):
            self._kick.set()  # evict now, not at the next interval

    def removed(self, *, namespace: str, size: int) -> None:
        self.usage.add(namespace=namespace, blocks=-1, nbytes=-size)

    # -- policy ----------------------------------------------------------------------------------------------

    def _over(self, namespace: str) -> bool:
        if self.max_bytes is not None and self.usage.bytes > self.max_bytes * self.high:
            return True
        return self.quota is not None and self.usage.of(namespace)[1] > self.quota * self.high

    def _over_any(self) -> bool:
        if self.max_bytes is not None and self.usage.bytes > self.max_bytes * self.high:
            return True
        return self.quota is not None and any(b > self.quota * self.high for _, b in self.usage.by_namespace.values())

    async def enforce(self) -> int:
        """Evict wherever usage is past the high watermark, down to the low one; the number evicted."""
        evicted = 0
        if self.max_bytes is not None and self.usage.bytes > self.max_bytes * self.high:
            evicted += await self.evict(target_bytes=int(self.max_bytes * self.low))
        if self.quota is not None:
            for ns in [n for n, (_, b) in self.usage.by_namespace.items() if b > self.quota * self.high]:
                evicted += await self.evict(target_bytes=int(self.quota * self.low), namespace=ns)
        return evicted

    def _current(self, namespace: str | None) -> int:
        return self.usage.bytes if namespace is None else self.usage.of(namespace)[1]

    async def evict(self, *, target_bytes: int, namespace: str | None = None) -> int:
        """Evict least recently used blocks until usage (of ``namespace``) is at most ``target_bytes``."""
        evicted = 0
        async with self._lock:
            if self._current(namespace) <= target_bytes:
                return 0
            await self.service.index.flush_access()  # reads of the last flush interval count
            while self._current(namespace) > target_bytes:
                candidates = await self.service.index.lru_candidates(limit=self.batch, namespace=namespace)
                chosen: list[Candidate] = []
                projected = self._current(namespace)
                for c in candidates:
                    if projected <= target_bytes:
                        break
                    if c.key in self.service.writing:
                        continue
                    chosen.append(c)
                    projected -= c.size
                if not chosen:
                    break
                gone = await self._remove(chosen)
                evicted += gone
                if gone == 0:
                    break
        if evicted:
            log.info("evicted blocks=%s namespace=%s usage_bytes=%s", evicted, namespace, self.usage.bytes)
        return evicted

    async def _remove(self, chosen: list[Candidate]) -> int:
        store, index, cache, writing = (
            self.service.store,
            self.service.index,
            self.service.cache,
            self.service.writing,
        )
        sem = asyncio.Semaphore(DELETE_CONCURRENCY)

        async def unlink(c: Candidate) -> bool:
            async with sem:
                if c.key in writing:  # a PUT started since the choice: leave it alone
                    return False
                cache.drop(c.key)
                await store.delete(c.key)
                return True

        unlinked = await asyncio.gather(*(unlink(c) for c in chosen))
        targets = [c for c, ok in zip(chosen, unlinked, strict=True) if ok]
        gone = await index.delete_if_unchanged(targets)
        for c in gone:
            cache.drop(c.key)  # a HEAD may have cached it between the unlink and the row delete
            self.usage.add(namespace=c.namespace, blocks=-1, nbytes=-c.size)
            self.evictions += 1
            self.evicted_bytes += c.size
        kept = {c.key for c in targets} - {c.key for c in gone}
        for key in kept:
            await self._repair(key)
        return len(gone)

    async def _repair(self, key: str) -> None:
        """A row rewritten during eviction: if its new data was unlinked too, drop the row (a miss, not a lie)."""
        if key in self.service.writing or await self.service.store.head(key) is not None:
            return
        record = await self.service.index.get(key)
        if record is not None and await self.service.index.delete_blocks([key]):
            self.service.cache.drop(key)
            self.usage.add(namespace=record.namespace, blocks=-1, nbytes=-record.size)
            log.warning("eviction raced a rewrite key=%s: row dropped", key)

    # -- the background task ---------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.interval_s)
            self._kick.clear()
            try:
                await self.enforce()
                if time.monotonic() - self._synced_at > self.resync_s and not self.service.writing:
                    async with self._lock:
                        await self.load()
            except KVGateError as exc:
                log.warning("eviction round failed: %s", exc)
