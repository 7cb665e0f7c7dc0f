"""Capacity: usage, admission of writes (507) and LRU eviction between two watermarks. Policy only: what to evict
and when to refuse. Removing a block or an upload is upkeep's (``Upkeep.evict``, ``drop_upload``: holding the key,
only if it is still the version chosen), so eviction never removes a version a PUT is writing.

Usage is (blocks, bytes) per namespace: block rows plus the stored parts of incomplete multi-part objects. The
index keeps it exact in every change's own transaction (a table moved by triggers, whoever commits: any gateway
process, replica, ``kvgate gc`` or ``kvgate import``); this process holds a view of it, read from the index at
start-up, before every eviction decision and every ``eviction_interval_s``, and moved in between by the exact delta
of each of its own commits. So one gateway alone sees exact usage at every moment, and several see each other's
writes within an interval; every decision to evict is made from a fresh read.

One evictor at a time: a round holds the coordination file's ``evict`` lock (the processes of one machine) and, on
PostgreSQL, an advisory lock (replicas on several machines); a process that wants room while another evicts waits
for that round, reads usage again, and evicts only what is still over. Candidates are the least recently read
blocks (``last_access``; HEAD and lookup do not touch) and idle uploads (their newest part's time), oldest first.
Uploads with no part for ``stale_upload_s`` are dropped by the same background task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from app.config import Settings
from app.core.coordination import Coordinator
from app.core.patience import patiently
from app.core.upkeep import Upkeep
from app.core.usage import Usage
from app.errors import InsufficientStorage, KVGateError
from app.index import BlockRecord, Index, Upload

log = logging.getLogger("kvgate.capacity")

EVICTOR_WAIT_S = 30.0
"""The longest a write waits for another process's eviction round before it is refused (507)."""


class Capacity:
    """Admission (BlockService's ``Admission``) and the evictor, over the usage view that ``Versions`` moves."""

    def __init__(
        self, *, usage: Usage, upkeep: Upkeep, index: Index, coordinator: Coordinator | None, settings: Settings
    ) -> None:
        self.usage = usage
        self._upkeep = upkeep
        self._index = index
        self._coordinator = coordinator
        self.max_bytes = settings.max_bytes
        self.quota = settings.namespace_quota_bytes
        self.high = settings.high_watermark
        self.low = settings.low_watermark
        self.interval_s = settings.eviction_interval_s
        self.batch = settings.eviction_batch
        self.stale_upload_s = settings.stale_upload_s
        self.reserved = 0
        self.reserved_by_ns: dict[str, int] = {}
        self.evictions = 0
        self.evicted_bytes = 0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def refresh(self) -> Usage:
        """Read usage from the index (exact as of the last commit of any process); the view, refreshed. The read
        is ordered with this process's commits (``Scans.usage_by_namespace``), so none is counted twice; while a
        commit's outcome is being settled (``Usage.settling``) the view is kept as it is (it moves by that commit
        once known)."""
        rows = await self._index.scans.usage_by_namespace()
        if not self.usage.settling:
            self.usage.reset(rows)
        return self.usage

    async def start(self, *, until: float | None = None) -> None:
        """The first read of usage (tried again in place until ``until``, start-up's deadline: a read, safe to
        repeat, whose COMMIT's reply may be lost as any other's), then the background task."""
        await patiently(self.refresh, what="usage read", until=until)
        self._task = asyncio.create_task(self._loop(), name="kvgate-capacity")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the hooks -------------------------------------------------------------------------------------------

    @property
    def bounded(self) -> bool:
        """A bound or a quota is set (``admit`` then needs the size a write replaces)."""
        return self.max_bytes is not None or self.quota is not None

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

    @property
    def evicting(self) -> bool:
        """An eviction round of this process, or of another process of this machine, is in flight now (a round
        elsewhere holds the coordination file's ``evict`` lock; a replica's on another machine is not seen)."""
        if self._lock.locked():
            return True
        return self._coordinator is not None and self._coordinator.held("evict")

    # -- policy ----------------------------------------------------------------------------------------------

    def _over_any(self) -> bool:
        if self.max_bytes is not None and self.usage.bytes > self.max_bytes * self.high:
            return True
        return self.quota is not None and any(b > self.quota * self.high for _, b in self.usage.by_namespace.values())

    async def enforce(self) -> int:
        """Evict wherever usage is past the high watermark, down to the low one; the number evicted. A round of
        this process in flight is waited for first (usage falls while it runs)."""
        async with self._lock:
            pass
        evicted = 0
        if self.max_bytes is not None and self.usage.bytes > self.max_bytes * self.high:
            evicted += await self.evict(target_bytes=int(self.max_bytes * self.low))
        if self.quota is not None:
            for ns in [n for n, (_, b) in self.usage.by_namespace.items() if b > self.quota * self.high]:
                evicted += await self.evict(target_bytes=int(self.quota * self.low), namespace=ns)
        return evicted

    def _current(self, namespace: str | None) -> int:
        return self.usage.bytes if namespace is None else self.usage.of(namespace)[1]

    @contextlib.asynccontextmanager
    async def _one_evictor(self) -> AsyncIterator[None]:
        """This process's round, and the only one across processes (the coordination file's ``evict`` lock on
        this machine; PostgreSQL's advisory lock across machines)."""
        async with self._lock, contextlib.AsyncExitStack() as held:
            try:
                async with asyncio.timeout(EVICTOR_WAIT_S):
                    if self._coordinator is not None:
                        await held.enter_async_context(self._coordinator.exclusive("evict"))
                    await held.enter_async_context(self._index.exclusive("evict"))
            except TimeoutError as exc:
                raise InsufficientStorage("another process's eviction round did not end in time") from exc
            yield

    async def evict(self, *, target_bytes: int, namespace: str | None = None) -> int:
        """Evict least recently used blocks and idle uploads until usage (of ``namespace``), read afresh, is at
        most ``target_bytes``."""
        evicted = 0
        async with self._one_evictor():
            await self._index.flush_access()  # reads of the last flush interval count
            await self.refresh()
            while self._current(namespace) > target_bytes:
                chosen = await self._choose(target_bytes, namespace)
                if not chosen:
                    break
                gone = await self._remove(chosen)
                evicted += gone
                await self.refresh()
                if gone == 0:
                    break
        if evicted:
            log.info("evicted=%s namespace=%s usage_bytes=%s", evicted, namespace, self.usage.bytes)
        return evicted

    async def _choose(self, target_bytes: int, namespace: str | None) -> list[BlockRecord | Upload]:
        blocks = await self._index.scans.lru_candidates(limit=self.batch, namespace=namespace)
        uploads = await self._index.scans.uploads(namespace=namespace)
        ordered: list[tuple[float, BlockRecord | Upload]] = [(c.last_access, c) for c in blocks]
        ordered += [(u.last_part_at, u) for u in uploads]
        ordered.sort(key=lambda item: item[0])
        chosen: list[BlockRecord | Upload] = []
        projected = self._current(namespace)
        for _, item in ordered:
            if projected <= target_bytes:
                break
            chosen.append(item)
            projected -= item.size if isinstance(item, BlockRecord) else item.bytes
        return chosen

    async def _remove(self, chosen: list[BlockRecord | Upload]) -> int:
        blocks = [c for c in chosen if isinstance(c, BlockRecord)]
        gone = await self._upkeep.evict(blocks)
        freed = sum(c.size for c in gone)
        dropped = 0
        for upload in (u for u in chosen if isinstance(u, Upload)):
            nbytes = await self._upkeep.drop_upload(upload, idle_since=upload.last_part_at)
            dropped += 1 if nbytes else 0
            freed += nbytes
        self.evictions += len(gone) + dropped
        self.evicted_bytes += freed
        return len(gone) + dropped

    # -- the background task ---------------------------------------------------------------------------------

    async def _grown_over(self) -> None:
        """Return once a commit of this process took usage past a high watermark."""
        while True:
            await self.usage.grew.wait()
            self.usage.grew.clear()
            if self._over_any():
                return

    async def _loop(self) -> None:
        swept_at = time.monotonic()
        while True:
            if not self._over_any():  # else evict at once: start-up over the bound, or a round cut short
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._grown_over(), self.interval_s)
            try:
                await self.refresh()
                await self.enforce()
                if time.monotonic() - swept_at > min(self.stale_upload_s, 60.0):
                    swept_at = time.monotonic()
                    await self._upkeep.drop_idle_uploads(idle_s=self.stale_upload_s)
            except KVGateError as exc:
                log.warning("capacity round failed: %s", exc)
