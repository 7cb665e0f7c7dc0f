"""Reading a block: the Range header, an opened version, and ranges verified against the whole object's digest."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator

from app.errors import BlockNotFound, DigestMismatch, SizeMismatch
from app.storage import ObjectReader
from app.storage.base import BodyChecker, Version

log = logging.getLogger("kvgate.reads")


class OpenBlock:
    """A block version opened for reading: its metadata and a reader of exactly that version."""

    def __init__(self, meta: Version, reader: ObjectReader) -> None:
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
