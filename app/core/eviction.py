"""Capacity: usage accounting, admission of PUTs (507) and LRU eviction between two watermarks. Policy only:
what to evict and when to refuse. Removing a block is BlockService's (``evict``: under the key's lock, the row
only if it still names the version chosen, then the data), so eviction never removes a version a PUT is writing.

Usage is an in-process running total of (blocks, bytes), overall and per namespace: block rows plus the stored
parts of incomplete multi-part objects. It is loaded from the index at start-up (after reconcile) and moved by
BlockService with the exact delta of every committed change (``changed``), so it equals the sum of the rows at
every moment. With several gateways sharing one index it is re-read periodically, when no change is in flight.

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
from app.core.service import BlockService
from app.errors import InsufficientStorage, KVGateError
from app.index import Candidate, NamespaceUsage
from contract.keys import InvalidKey, parse_block_key

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

    async def load(self) -> bool:
        """Re-read usage from the index (block rows and stored parts); False if a change committed meanwhile."""
        svc = self.service
        epoch = svc.cache.epoch
        rows = await svc.index.namespace_usage()
        parts = await svc.index.part_bytes()
        if svc.changing or svc.cache.epoch != epoch:
            return False
        self.usage.reset(rows)
        for key, nbytes in parts.items():
            with contextlib.suppress(InvalidKey):
                self.usage.add(namespace=parse_block_key(key).namespace, blocks=0, nbytes=nbytes)
        self._synced_at = time.monotonic()
        return True

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

    async def admit(self, *, namespace: str, size: int, replacing: int, whole: int | None = None) -> None:
        """Reserve room for ``size`` bytes (evicting if need be); ``whole``: the object a part of it belongs to,
        refused at its first part if it can never fit."""
        block = max(size, whole or 0)
        if self.max_bytes is not None and block > self.max_bytes:
            raise InsufficientStorage(f"a {block}-byte block can never fit in max_bytes={self.max_bytes}")
        if self.quota is not None and block > self.quota:
            raise InsufficientStorage(f"a {block}-byte block can never fit in the namespace quota {self.quota}")
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

    def changed(self, *, namespace: str, blocks: int, nbytes: int) -> None:
        self.usage.add(namespace=namespace, blocks=blocks, nbytes=nbytes)
        if nbytes > 0 and self._over(namespace):
            self._kick.set()  # evict now, not at the next interval

    @property
    def evicting(self) -> bool:
        """An eviction round (or a usage resync) holds the capacity lock now."""
        return self._lock.locked()

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
        gone = await self.service.evict(chosen)
        self.evictions += len(gone)
        self.evicted_bytes += sum(c.size for c in gone)
        return len(gone)

    # -- the background task ---------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.interval_s)
            self._kick.clear()
            try:
                await self.enforce()
                if time.monotonic() - self._synced_at > self.resync_s and not self.service.changing:
                    async with self._lock:
                        await self.load()
            except KVGateError as exc:
                log.warning("eviction round failed: %s", exc)
