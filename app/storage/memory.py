"""A real, bounded-by-the-caller in-memory store with the same semantics as the others (for unit tests)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import cast

from app.errors import BlockNotFound, VersionMismatch
from app.storage.base import BlockStore, BodyChecker, ClosingReader, ObjectInfo, Staged, Version
from contract.wire import DEFAULT_ALGORITHM


class MemoryReader(ClosingReader):
    __slots__ = ("_chunk", "_data", "size")

    def __init__(self, data: bytes, chunk_bytes: int) -> None:
        self._data = data
        self._chunk = chunk_bytes
        self.size = len(data)

    async def chunks(self, *, start: int, end: int) -> AsyncIterator[bytes]:
        view = memoryview(self._data)
        for pos in range(start, end, self._chunk):
            yield bytes(view[pos : min(end, pos + self._chunk)])

    async def aclose(self) -> None:
        return None


class MemoryStore(BlockStore):
    """One object per key, each version stamped with a counter (``stage`` holds the bytes until ``publish``)."""

    def __init__(self, *, chunk_bytes: int = 4 * 1024 * 1024) -> None:
        self._objects: dict[str, tuple[bytes, float, str]] = {}
        self._chunk = chunk_bytes
        self._versions = itertools.count(1)
        self._released: dict[tuple[str, str], bytes] = {}
        """Staged versions let go of with their commit's outcome unknown (``release``), for ``roll_forward``."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._objects.clear()

    async def check(self) -> None:
        return None

    async def put(
        self, key: str, body: AsyncIterable[bytes], *, size: int, expected_digest: str | None = None
    ) -> Version:
        checker = BodyChecker(size=size, expected_digest=expected_digest)
        buf = bytearray()
        async for chunk in body:
            checker.update(chunk)
            buf += chunk
        meta = checker.finish()
        self._objects[key] = (bytes(buf), time.time(), str(next(self._versions)))
        return meta

    async def stage(
        self,
        key: str,
        body: AsyncIterable[bytes],
        *,
        size: int,
        expected_digest: str | None = None,
        algorithm: str | None = None,
        stamp: str | None = None,
    ) -> Staged:
        if stamp is not None:
            raise ValueError("this store names its versions itself (new_stamp is None)")
        checker = BodyChecker(size=size, expected_digest=expected_digest, algorithm=algorithm)
        buf = bytearray()
        async for chunk in body:
            checker.update(chunk)
            buf += chunk
        return Staged(key=key, meta=checker.finish(), stamp=str(next(self._versions)), handle=bytes(buf))

    async def publish(self, staged: Staged) -> None:
        self._objects[staged.key] = (cast(bytes, staged.handle), time.time(), staged.stamp)

    async def discard(self, staged: Staged) -> None:
        return None

    async def release(self, staged: Staged) -> None:
        self._released[(staged.key, staged.stamp)] = cast(bytes, staged.handle)

    async def roll_forward(self, key: str, stamp: str) -> bool:
        data = self._released.pop((key, stamp), None)
        if data is None:
            return False
        self._objects[key] = (data, time.time(), stamp)
        return True

    async def remove(self, key: str, *, stamp: str | None) -> bool:
        """Remove the key's object if it is version ``stamp`` (None: whatever is there)."""
        entry = self._objects.get(key)
        if entry is None or (stamp is not None and entry[2] != stamp):
            return False
        del self._objects[key]
        return True

    async def open(self, key: str, *, stamp: str | None = None) -> MemoryReader:
        try:
            data, _, found = self._objects[key]
        except KeyError:
            raise BlockNotFound(key) from None
        if stamp is not None and found != stamp:
            raise VersionMismatch(f"{key!r} holds version {found}, the index names {stamp}")
        return MemoryReader(data, self._chunk)

    async def head(self, key: str) -> int | None:
        entry = self._objects.get(key)
        return None if entry is None else len(entry[0])

    async def delete(self, key: str) -> bool:
        return self._objects.pop(key, None) is not None

    async def digest(self, key: str, *, algorithm: str = DEFAULT_ALGORITHM) -> Version:
        entry = self._objects.get(key)
        if entry is None:
            raise BlockNotFound(key)
        data, _, stamp = entry
        checker = BodyChecker(size=len(data), expected_digest=None, algorithm=algorithm)
        checker.update(data)
        return dataclasses.replace(checker.finish(), stamp=stamp)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        for key in sorted(self._objects):
            if key.startswith(prefix):
                data, mtime, stamp = self._objects[key]
                yield ObjectInfo(key=key, size=len(data), mtime=mtime, stamp=stamp)
