"""What BlockService keeps in memory per key: a lock that orders each key's changes, and a metadata cache."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """One version of a block, as its index row names it: everything a reader answers with comes from here."""

    key: str
    size: int
    digest: str
    stamp: str | None = None
    """The stored version (app.storage.base.Staged.stamp): a reader opens exactly this one."""


class KeyLocks:
    """One asyncio.Lock per key with a change in flight; a key nobody holds costs nothing (weak references)."""

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def __call__(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    def held(self, key: str) -> bool:
        """A change of ``key`` is in flight now."""
        lock = self._locks.get(key)
        return lock is not None and lock.locked()

    async def settle(self, key: str) -> None:
        """Wait until the change of ``key`` in flight now (if any) is done."""
        lock = self._locks.get(key)
        if lock is not None and lock.locked():
            async with lock:
                pass


class MetaCache:
    """Bounded LRU of block metadata, optionally with a time-to-live (several gateways sharing one index).

    An entry is filled by a reader only if no change of any key started or ended while it read the index
    (``epoch``) and no change of its key is in flight when it fills it (BlockService._row): so a reader that read a
    row just before a PUT replaced it cannot put the old row back after the PUT's entry, and a read made wholly
    inside a removal (after its lock, before its commit) cannot keep the removed row.
    """

    def __init__(self, *, entries: int, ttl_s: float | None) -> None:
        self._entries = entries
        self._ttl = ttl_s
        self._data: OrderedDict[str, tuple[BlockMeta, float]] = OrderedDict()
        self.epoch = 0
        """Bumped by every change of a key (BlockService), before its index write."""

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

    def put(self, meta: BlockMeta, *, read_at_epoch: int | None = None) -> None:
        """Remember ``meta``; a reader passes the epoch it read the index at, and is ignored if it moved."""
        if self._entries == 0 or self._ttl == 0:
            return
        if read_at_epoch is not None and read_at_epoch != self.epoch:
            return
        self._data[meta.key] = (meta, time.monotonic())
        self._data.move_to_end(meta.key)
        while len(self._data) > self._entries:
            self._data.popitem(last=False)

    def drop(self, key: str) -> None:
        self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()
