"""What the core keeps per key: the lock that orders a key's changes (within a process and, through the
coordination file, across the processes of one data directory) and the metadata cache of its rows."""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from app.core.coordination import Coordinator, Epochs, LocalEpochs, stripe_of
from app.storage.base import Version


@dataclass(slots=True)
class Held:
    """A key held for a change; ``end_epoch`` is its stripe's epoch as the change left it (set on release)."""

    end_epoch: int = -1


class KeyLocks:
    """Holds a key for one change: first an asyncio.Lock of this process (one per key with a change in flight,
    weakly kept), then the key's stripe lock in the coordination file (other processes, and other keys of the
    stripe in this one). The stripe's epoch is odd for as long as the key is held."""

    def __init__(self, coordinator: Coordinator | None = None) -> None:
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._coordinator = coordinator
        self.epochs: Epochs = coordinator if coordinator is not None else LocalEpochs()

    def _lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[Held]:
        stripe = stripe_of(key)
        held = Held()
        async with self._lock(key):
            shared = self._coordinator.locked(stripe) if self._coordinator else contextlib.nullcontext()
            async with shared:
                if self._coordinator is not None:
                    self._coordinator.check()  # a replaced file's lock excludes nobody: refuse (503)
                self.epochs.begin(stripe)
                try:
                    yield held
                finally:
                    self.epochs.end(stripe)
                    held.end_epoch = self.epochs.get(stripe)

    def held(self, key: str) -> bool:
        """A change of ``key`` is in flight in this process now."""
        lock = self._locks.get(key)
        return lock is not None and lock.locked()

    async def settle(self, key: str) -> None:
        """Wait until a change of ``key`` in flight now, here or in another process, is done."""
        lock = self._locks.get(key)
        if lock is not None and lock.locked():
            async with lock:
                pass
        if self._coordinator is not None:
            await self._coordinator.wait_free(stripe_of(key))


class MetaCache:
    """Bounded LRU of block rows, each kept with the epoch of its key's stripe at the time it was read; an entry
    whose stripe's epoch has moved since (a change of the key, here or in another process) is not served.

    A reader fills an entry only if the epoch was even (no change in flight) and unchanged across its index read
    (``fill``); a change puts the row it made once it is done. An optional time-to-live bounds how long a row is
    trusted where changes come from other machines (replicas sharing PostgreSQL), which no epoch sees.
    """

    def __init__(self, *, entries: int, ttl_s: float | None, epochs: Epochs | None = None) -> None:
        self._entries = entries
        self._ttl = ttl_s
        self.epochs: Epochs = epochs if epochs is not None else LocalEpochs()
        self._data: OrderedDict[str, tuple[Version, int, float, int]] = OrderedDict()
        """key -> (row, the stripe's epoch when it was read, when, the key's stripe: kept, not hashed per hit)"""

    @property
    def enabled(self) -> bool:
        return self._entries > 0 and self._ttl != 0

    def get(self, key: str) -> Version | None:
        item = self._data.get(key)
        if item is None:
            return None
        if not self.epochs.intact():  # the epochs are no longer shared: no entry can be trusted
            self._data.clear()
            return None
        meta, epoch, filled, stripe = item
        if epoch != self.epochs.get(stripe) or (self._ttl is not None and time.monotonic() - filled > self._ttl):
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return meta

    def epoch_of(self, key: str) -> int:
        return self.epochs.get(stripe_of(key))

    def fill(self, meta: Version, *, read_at_epoch: int) -> None:
        """Remember ``meta`` read from the index when the key's epoch was ``read_at_epoch`` (ignored if a change
        was in flight then, or has been since)."""
        if read_at_epoch % 2 == 0 and read_at_epoch == self.epoch_of(meta.key):
            self._put(meta, read_at_epoch)

    def made(self, meta: Version, *, epoch: int) -> None:
        """The row a change just made; ``epoch`` is the one the change left (``Held.end_epoch``): if another change
        of the key has begun since, the entry is stale at once and never served."""
        if epoch % 2 == 0:
            self._put(meta, epoch)

    def _put(self, meta: Version, epoch: int) -> None:
        if not self.enabled or not self.epochs.intact():
            return
        self._data[meta.key] = (meta, epoch, time.monotonic(), stripe_of(meta.key))
        self._data.move_to_end(meta.key)
        while len(self._data) > self._entries:
            self._data.popitem(last=False)

    def drop(self, key: str) -> None:
        self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()
