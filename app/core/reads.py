"""Reading a block: an opened version, and the checksum of any byte range of it, vouched for without buffering it.

A reader at another TP size asks for a byte range, which the whole object's checksum (the ETag) cannot vouch for.
The gateway answers every 206 with ``X-KVGate-Range-Checksum: crc64nvme=<base64>`` of exactly the range's bytes,
before sending them:

- a version with chunk CRCs (every version written since revision 0005; app/storage/checksums.py): the range's CRC
  is combined from the recorded CRCs of the chunks it covers whole; a chunk it cuts is read and checked against its
  recorded CRC, for the CRC of its piece. At most two chunks are read (none for an aligned range), whatever the
  object's size; the bytes are then streamed, and the client checks them against the header as they arrive.
- a version without them (a row from before 0005, an S3 object adopted from its metadata): the whole object is read
  once and checked against its checksum, the range's CRC taken on the way, then the range is streamed (a second read
  of it; nothing is held in memory).

A version stored with a sha256 (an earlier client's, or one who asked for it) also gets the range's sha256 in
``X-KVGate-Range-SHA256`` (earlier clients check that one): every chunk the range touches is then read and checked.
A mismatch is corruption at rest: BlockNotFound (a miss, which the engine recomputes), never the bytes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from app.errors import BlockNotFound, DigestMismatch, SizeMismatch
from app.storage import ObjectReader
from app.storage.base import BodyChecker, Version
from app.storage.checksums import Chunks, algorithm_of, combine, crc64nvme
from contract.wire import CRC64NVME, SHA256, Checksum

log = logging.getLogger("kvgate.reads")


class OpenBlock:
    """A block version opened for reading: its metadata and a reader of exactly that version."""

    def __init__(self, meta: Version, reader: ObjectReader) -> None:
        self.meta = meta
        self.reader = reader

    async def stream(self, start: int, end: int) -> AsyncIterator[bytes | bytearray]:
        try:
            async for chunk in self.reader.chunks(start=start, end=end):
                yield chunk
        finally:
            await self.reader.aclose()


@dataclass(frozen=True, slots=True)
class RangeProof:
    """What the gateway vouches for a range ``[start, end)`` of a version."""

    crc: Checksum
    """CRC64NVME of exactly the range's bytes."""
    sha256: str | None
    """Hex sha256 of the range's bytes, for a version stored with a sha256 (earlier clients check it)."""


class _RangeHash:
    """The checksums of the bytes of ``[start, end)``, fed pieces of the object in order with their position."""

    __slots__ = ("_sha", "crc", "end", "length", "start")

    def __init__(self, start: int, end: int, *, sha: bool) -> None:
        self.start = start
        self.end = end
        self.crc = 0
        self.length = 0
        self._sha = hashlib.sha256() if sha else None

    def feed(self, piece: memoryview, pos: int) -> None:
        lo, hi = max(self.start, pos), min(self.end, pos + len(piece))
        if lo < hi:
            inner = piece[lo - pos : hi - pos]
            self.crc = crc64nvme(inner, self.crc)
            self.length += hi - lo
            if self._sha is not None:
                self._sha.update(inner)

    def sha256(self) -> str | None:
        return None if self._sha is None else self._sha.hexdigest()


async def vouch_range(block: OpenBlock, start: int, end: int) -> RangeProof:
    """The checksums of ``[start, end)`` of ``block``'s version, checked against what was recorded of it (see the
    module docstring); BlockNotFound if the stored bytes are not those. The reader stays open."""
    meta = block.meta
    sha = algorithm_of(meta.digest) == SHA256
    try:
        if meta.chunks is not None and meta.chunks.fits(meta.size):
            return await _from_chunks(block.reader, meta, meta.chunks, start, end, sha=sha)
        return await _whole(block.reader, meta, start, end, sha=sha)
    except (DigestMismatch, SizeMismatch) as exc:
        log.error("corrupt block key=%s: %s", meta.key, exc)
        raise BlockNotFound(meta.key) from exc


async def _whole(reader: ObjectReader, meta: Version, start: int, end: int, *, sha: bool) -> RangeProof:
    """Read the whole version once, check it against its checksum, and hash the range on the way."""
    checker = BodyChecker(size=meta.size, expected_digest=meta.digest)
    ranged = _RangeHash(start, end, sha=sha)
    pos = 0
    async for data in reader.chunks(start=0, end=meta.size):
        checker.update(data)
        ranged.feed(memoryview(data).cast("B"), pos)
        pos += len(data)
    checker.finish()
    return RangeProof(Checksum.of(CRC64NVME, ranged.crc), ranged.sha256())


async def _from_chunks(
    reader: ObjectReader, meta: Version, chunks: Chunks, start: int, end: int, *, sha: bool
) -> RangeProof:
    """Combine the range's CRC from the chunks it covers; read (and check) only the chunks it cuts, or every chunk
    it touches when a sha256 of the range is wanted."""
    size, step = meta.size, chunks.size
    first, last = start // step, (end - 1) // step

    def bounds(i: int) -> tuple[int, int]:
        return i * step, min((i + 1) * step, size)

    def read(i: int) -> bool:
        lo, hi = bounds(i)
        return sha or lo < start or hi > end

    crc, sha_hex = 0, None
    i = first
    while i <= last:
        if not read(i):  # covered whole: its recorded CRC is the piece's
            lo, hi = bounds(i)
            crc = combine(crc, chunks.crc(i), hi - lo)
            i += 1
            continue
        j = i
        while j < last and read(j + 1):
            j += 1
        run = _RangeHash(start, end, sha=sha)
        await _check_run(reader, chunks, bounds(i)[0], bounds(j)[1], first_chunk=i, ranged=run)
        crc = combine(crc, run.crc, run.length)
        sha_hex = run.sha256()  # with a sha256 wanted every chunk is read: one run
        i = j + 1
    return RangeProof(Checksum.of(CRC64NVME, crc), sha_hex)


async def _check_run(
    reader: ObjectReader, chunks: Chunks, lo: int, hi: int, *, first_chunk: int, ranged: _RangeHash
) -> None:
    """Read ``[lo, hi)`` (whole chunks from ``first_chunk`` on), check each chunk against its recorded CRC, and feed
    ``ranged`` the bytes."""
    step = chunks.size
    index, chunk_crc, filled, pos = first_chunk, 0, 0, lo
    async for data in reader.chunks(start=lo, end=hi):
        view = memoryview(data).cast("B")
        at = 0
        while at < len(view):
            chunk_end = min((index + 1) * step, hi)
            take = min(len(view) - at, chunk_end - pos)
            piece = view[at : at + take]
            chunk_crc = crc64nvme(piece, chunk_crc)
            ranged.feed(piece, pos)
            filled += take
            pos += take
            at += take
            if pos == chunk_end:
                if chunk_crc != chunks.crc(index):
                    raise DigestMismatch(f"bytes {chunk_end - filled}-{chunk_end - 1} are not the chunk recorded")
                index, chunk_crc, filled = index + 1, 0, 0
    if pos != hi:
        raise SizeMismatch(f"read ended at byte {pos} of {hi}")
