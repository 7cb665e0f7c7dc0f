"""A real, bounded-by-the-caller in-memory store with the same semantics as the others (for unit tests)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator

from app.errors import BlockNotFound
from app.storage.base import BodyChecker, ObjectInfo, ObjectMeta


class MemoryReader:
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


class MemoryStore:
    def __init__(self, *, chunk_bytes: int = 4 * 1024 * 1024) -> None:
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._chunk = chunk_bytes

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._objects.clear()

    async def check(self) -> None:
        return None

    async def put(
        self, key: str, body: AsyncIterable[bytes], *, size: int, expected_digest: str | None = None
    ) -> ObjectMeta:
        checker = BodyChecker(size=size, expected_digest=expected_digest)
        buf = bytearray()
        async for chunk in body:
            checker.update(chunk)
            buf += chunk
        meta = checker.finish()
        self._objects[key] = (bytes(buf), time.time())
        return meta

    async def open(self, key: str) -> MemoryReader:
        try:
            data, _ = self._objects[key]
        except KeyError:
            raise BlockNotFound(key) from None
        return MemoryReader(data, self._chunk)

    async def head(self, key: str) -> int | None:
        entry = self._objects.get(key)
        return None if entry is None else len(entry[0])

    async def delete(self, key: str) -> bool:
        return self._objects.pop(key, None) is not None

    async def digest(self, key: str) -> ObjectMeta:
        reader = await self.open(key)
        checker = BodyChecker(size=reader.size, expected_digest=None)
        async for chunk in reader.chunks(start=0, end=reader.size):
            checker.update(chunk)
        return checker.finish()

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        for key in sorted(self._objects):
            if key.startswith(prefix):
                data, mtime = self._objects[key]
                yield ObjectInfo(key=key, size=len(data), mtime=mtime)
