"""The BlockStore protocol. Stores raise only domain errors (app.errors); they know nothing of HTTP."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Protocol, Self

from app.errors import DigestMismatch, SizeMismatch


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    size: int
    digest: str
    """Hex sha256 of the whole object."""
    stamp: str | None = None
    """The version these bytes were read from, where the store names versions (``digest``)."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float
    stamp: str | None = None
    """The version stamp of this copy of ``key`` (see ``Staged.stamp``); None for an unversioned object."""


@dataclass(frozen=True, slots=True)
class Staged:
    """A block version written in full and checked, but not yet visible under its key.

    ``stamp`` names this version in the store, and goes into the index row: the filesystem's is the file's
    ``<inode>:<mtime_ns>`` (kept by the rename that publishes it), S3's the suffix of the object name that holds it.
    A reader that opens ``key`` with the row's stamp gets that version or a ``VersionMismatch``, never another body.
    """

    key: str
    meta: ObjectMeta
    stamp: str
    handle: object
    """The store's own reference to the written bytes (a temp path, an object name, the bytes)."""


class ObjectReader(Protocol):
    """An open object: its size, and its bytes in ``[start, end)`` as chunks; ``aclose`` releases it.

    An async context manager: ``async with await store.open(key) as reader:`` closes it however the block ends.
    """

    size: int

    def chunks(self, *, start: int, end: int) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc: object) -> None: ...


class ClosingReader:
    """``__aenter__``/``__aexit__`` for a reader class that defines ``aclose``."""

    __slots__ = ()

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class BlockStore(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def check(self) -> None:
        """Raise BackendUnavailable unless the store can serve reads and writes."""

    async def put(
        self, key: str, body: AsyncIterable[bytes], *, size: int, expected_digest: str | None = None
    ) -> ObjectMeta:
        """Store exactly ``size`` bytes under ``key``, atomically: readers see the old object or the new one.

        The sha256 is computed while streaming; on a short/long body (SizeMismatch), a digest that is not
        ``expected_digest`` (DigestMismatch), a failing body iterator or a cancelled request nothing is published
        and no temporary data is left behind.
        """

    async def open(self, key: str, *, stamp: str | None = None) -> ObjectReader:
        """Open ``key`` for reading; BlockNotFound on a miss, VersionMismatch if it is not the version ``stamp``."""

    async def stage(
        self, key: str, body: AsyncIterable[bytes], *, size: int, expected_digest: str | None = None
    ) -> Staged:
        """Write and check a new version of block ``key`` without making it visible (``put``'s checks apply)."""

    async def publish(self, staged: Staged) -> None:
        """Make a staged version the one under its key (filesystem: the rename; S3: nothing, the row names it)."""

    async def discard(self, staged: Staged) -> None:
        """Drop a staged version that will never be published."""

    async def remove(self, key: str, *, stamp: str | None) -> bool:
        """Remove the version ``stamp`` of block ``key`` (None: the unversioned object); False if not there."""

    async def head(self, key: str) -> int | None:
        """The object's size, or None on a miss."""

    async def delete(self, key: str) -> bool:
        """Remove ``key``; False if it was not there."""

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every stored object whose key starts with ``prefix`` (published objects only, never temp data)."""

    async def digest(self, key: str) -> ObjectMeta:
        """Read the object back and compute its metadata (used by reconcile/adopt)."""


@dataclass(frozen=True, slots=True)
class Region:
    """``[start, end)`` of an upload file, whose bytes must hash to ``digest`` (one part of a multi-part object)."""

    start: int
    end: int
    digest: str


class UploadStore(Protocol):
    """A store that can write the parts of one object into the object's own file (the filesystem): the parts then
    become the object, with no second copy (app/core/parts.py). Stores without it keep one object per part."""

    async def write_at(self, key: str, offset: int, pieces: list[bytes]) -> None:
        """Write ``pieces`` at ``offset`` of upload ``key`` (created if missing), durably if the store fsyncs."""

    async def stage_upload(self, key: str, target: str, regions: list[Region], total: int) -> Staged:
        """Stage upload ``key`` as a version of block ``target`` without copying it: the upload must be ``total``
        bytes and each region must hash to its digest (else DigestMismatch), and the whole is hashed for the
        version's digest. The upload itself stays until deleted."""


class BodyChecker:
    """Counts and hashes a body as it streams, raising before the store publishes anything that is wrong."""

    __slots__ = ("_hasher", "_received", "expected_digest", "size")

    def __init__(self, *, size: int, expected_digest: str | None) -> None:
        self.size = size
        self.expected_digest = expected_digest.lower() if expected_digest else None
        self._hasher = hashlib.sha256()
        self._received = 0

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self._received += len(chunk)
        if self._received > self.size:
            raise SizeMismatch(f"body is longer than Content-Length {self.size}")
        self._hasher.update(chunk)

    def finish(self) -> ObjectMeta:
        if self._received != self.size:
            raise SizeMismatch(f"body ended after {self._received} of {self.size} bytes")
        digest = self._hasher.hexdigest()
        if self.expected_digest is not None and digest != self.expected_digest:
            raise DigestMismatch(f"body sha256 is {digest}, the request said {self.expected_digest}")
        return ObjectMeta(size=self.size, digest=digest)


async def coalesce(body: AsyncIterable[bytes], *, chunk_bytes: int) -> AsyncIterator[bytes]:
    """Regroup a stream of small network chunks into chunks of at least ``chunk_bytes`` (the last may be less)."""
    buf = bytearray()
    async for piece in body:
        if not buf and len(piece) >= chunk_bytes:
            yield piece
            continue
        buf += piece
        if len(buf) >= chunk_bytes:
            yield bytes(buf)
            buf.clear()
    if buf:
        yield bytes(buf)
