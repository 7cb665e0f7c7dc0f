"""The BlockStore protocol. Stores raise only domain errors (app.errors); they know nothing of HTTP."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Self

from app.errors import BlockNotFound, DigestMismatch, SizeMismatch, VersionMismatch
from app.storage.checksums import Chunks, chunk_bytes_for, combine, crc64nvme
from contract.wire import ALGORITHMS, CRC64NVME, DEFAULT_ALGORITHM, SHA256, Checksum, parse_checksum_token


@dataclass(frozen=True, slots=True)
class Version:
    """One version of a block (or of any stored object): the size and digest of its bytes, the store's stamp for
    it where the store names versions, and its key where one is known (a body checked on its way in has none yet).
    What a store returns, what the core answers with (HEAD, GET, PUT), all one type."""

    size: int
    digest: str
    """The whole object's checksum token (``contract.wire.Checksum.token``: ``crc64nvme:<hex>``, or the bare hex of
    a sha256, as every version before CRC64NVME)."""
    stamp: str | None = None
    """The version these bytes are (``Staged.stamp``): a reader opens exactly this one."""
    key: str = ""
    chunks: Chunks | None = None
    """The CRC64NVME of each chunk of the bytes (app/storage/checksums.py), where they were read to get here (None:
    not known, e.g. a row from before chunk checksums, or a checksum taken from an object's metadata); a Range GET
    is vouched for from them."""


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

    ``stamp`` names this version in the store, and goes into the index row: the filesystem's is a random id and
    the file's mtime, kept with the file (app/storage/fs_files.py), S3's the suffix of the object name that holds
    it. Stamps never repeat: a reader that opens ``key`` with the row's stamp gets that version or a
    ``VersionMismatch``, never another body.
    """

    key: str
    meta: Version
    stamp: str
    handle: object
    """The store's own reference to the written bytes (a temp path, an object name, the bytes)."""
    staged_at: float = field(default_factory=time.monotonic)
    """When it was written (monotonic): a version kept unnamed too long may be swept as a leftover (S3)."""


class ObjectReader(Protocol):
    """An open object: its size, and its bytes in ``[start, end)`` as chunks; ``aclose`` releases it.

    An async context manager: ``async with await store.open(key) as reader:`` closes it however the block ends.
    """

    size: int

    def chunks(self, *, start: int, end: int) -> AsyncIterator[bytes | bytearray]: ...

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
    """Where block bytes live. Stores subclass this protocol: the abilities below the line have do-nothing
    defaults, so a store that lacks one behaves the declared way (and the contract suite covers every store).

    Block versions: ``stage`` writes a version in full, checked and durable but invisible; ``publish`` makes it the
    one under its key (after the index row naming it committed); ``remove`` takes one version away, durably. Plain
    objects (namespace configs, part data): ``put``, ``open`` without a stamp, ``delete``.
    """

    versioned: ClassVar[bool] = False
    """Each version is an object of its own (S3): a replaced version lingers until it is retired. Otherwise a key
    holds one version at a time (its file), which publishing replaces."""
    uploads: ClassVar[bool] = False
    """The parts of a multi-part object can be written into the object's own upload (``place``,
    ``stage_upload``: the filesystem); otherwise each part is a plain object of its own."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def check(self) -> None:
        """Raise BackendUnavailable unless the store can serve reads and writes."""

    async def put(
        self, key: str, body: AsyncIterable[bytes], *, size: int, expected_digest: str | None = None
    ) -> Version:
        """Store exactly ``size`` bytes under ``key``, atomically: readers see the old object or the new one.

        The checksum is computed while streaming (``BodyChecker``: ``expected_digest`` is a ``Checksum.token``, its
        algorithm the one computed); on a short/long body (SizeMismatch), a checksum that is not
        ``expected_digest`` (DigestMismatch), a failing body iterator or a cancelled request nothing is published
        and no temporary data is left behind.
        """

    async def open(self, key: str, *, stamp: str | None = None) -> ObjectReader:
        """Open ``key`` for reading; BlockNotFound on a miss, VersionMismatch if it is not the version ``stamp``."""

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
        """Write and check a new version of block ``key`` without making it visible (``put``'s checks apply; with
        no ``expected_digest`` its checksum is computed in ``algorithm``, by default kvgate's); it is durable once
        this returns, and its stamp never names another version, on any store. Its meta carries the chunk CRCs.
        ``stamp``: the version's stamp, from ``new_stamp`` (a versioned store; others name their own)."""

    def new_stamp(self) -> str | None:
        """(``versioned`` stores) A fresh stamp for ``stage``, so that the version can be fenced in the index before
        it is written (app/index/staging.py); None: the store names its versions itself."""
        return None

    async def publish(self, staged: Staged) -> None:
        """Make a staged version the one under its key (filesystem: the rename; S3: nothing, the row names it)."""

    async def discard(self, staged: Staged) -> None:
        """Drop a staged version that will never be published."""

    async def remove(self, key: str, *, stamp: str | None) -> bool:
        """Remove version ``stamp`` of block ``key`` (None: the unversioned object), durably before returning, and
        only that version: a key that holds another one keeps it. False if that version was not there."""

    async def head(self, key: str) -> int | None:
        """The object's size, or None on a miss."""

    async def delete(self, key: str) -> bool:
        """Remove ``key``; False if it was not there."""

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every stored object whose key starts with ``prefix`` (published objects only, never staged data)."""

    async def digest(self, key: str, *, algorithm: str = DEFAULT_ALGORITHM) -> Version:
        """Read the object under ``key`` back and compute its metadata (its checksum in ``algorithm``, and its chunk
        CRCs), with its stamp (used by reconcile)."""

    # -- abilities with do-nothing defaults -------------------------------------------------------------------

    async def has_version(self, key: str, stamp: str) -> bool:
        """Version ``stamp`` of ``key`` is stored (and, where the key holds one version, is the one there)."""
        try:
            reader = await self.open(key, stamp=stamp)
        except (BlockNotFound, VersionMismatch):
            return False
        await reader.aclose()
        return True

    async def release(self, staged: Staged) -> None:
        """Let go of a staged version, neither published nor dropped: the commit of the row naming it has an unknown
        outcome. Recovery publishes it if the key's row names it and drops it if not (the filesystem: a staged file
        no writer holds; S3: the row names the object, or reconcile removes it unnamed). Default: nothing to do."""
        return None

    async def roll_forward(self, key: str, stamp: str) -> bool:
        """Publish version ``stamp`` of ``key`` if it was staged and never published (a crash between the index
        commit naming it and its publication); False if there is no such staged version. Default: publishing is
        nothing on this store, so there is never anything to roll forward."""
        return False

    def open_now(self, key: str, *, stamp: str, size: int) -> int | None:
        """A descriptor of a local file holding version ``stamp`` (``size`` bytes) of ``key``, opened on the calling
        thread without waiting on a disk, for the kernel to send as it is; None when the store cannot (default: no
        store but the filesystem's keeps local files). The caller closes it."""
        return None

    def issued(self, stamp: str | None) -> bool:
        """``stamp`` (as ``digest``, ``list`` or ``open`` report it) names a version this store wrote and that has
        not changed since, as opposed to data another program wrote (or changed) under the key."""
        return stamp is not None

    async def restamp(self, key: str, *, stamp: str) -> str | None:
        """Give the data under ``key``, if it is still ``stamp`` (one of an earlier release's stamps), a stamp of
        this store's own without reading it; the new stamp, or None if it is not that version (default: stamps
        never change)."""
        return None

    async def claim(self, key: str, *, algorithm: str = DEFAULT_ALGORITHM) -> Version:
        """The data under ``key`` (written by another program, or from before version stamps), read back, hashed
        (in ``algorithm``) and given a version stamp of this store's own where it keeps them; BlockNotFound if there
        is none. Default: its digest, with whatever stamp it has."""
        return await self.digest(key, algorithm=algorithm)

    async def clear(self, key: str, *, stamp: str | None) -> bool:
        """Remove whatever block ``key`` holds, whichever version it is, and version ``stamp`` (the one its row
        named) wherever the store may still hold it unpublished, durably before returning; called once the key's
        row is gone, holding the key, so that nothing is left for recovery to adopt again. True if anything went.
        Default: the key holds its data under its own name only."""
        return await self.remove(key, stamp=None)

    async def quarantine(self, key: str, *, stamp: str | None) -> bool:
        """Take version ``stamp`` of ``key`` (bytes judged corrupt) out of every read, listing and adoption,
        durably, before its row goes: a crash then leaves a row without data (a miss), never corrupt bytes
        without a row. False if that version was not there. Default: it is removed (S3: a version object without a
        row is never adopted, and a copy of the bad bytes would only be more to skip)."""
        return await self.remove(key, stamp=stamp)

    async def leftovers(self) -> Sequence[Leftover]:
        """Staged versions that their writer left behind (it is gone: crashed, killed, or the machine stopped)
        and never published or discarded. Default: this store leaves no staged data behind its writers."""
        return []

    async def drop_leftover(self, leftover: Leftover) -> bool:
        """Remove a staged version found by ``leftovers`` (unless a writer holds it again); False if it is gone."""
        return False

    async def remove_empty_dirs(self, prefix: str, *, older_than_s: float) -> int:
        """Remove empty directories under ``prefix`` untouched for ``older_than_s``; how many. Default: none."""
        return 0

    async def place(self, key: str, offset: int, source: Staged) -> None:
        """(``uploads`` stores) Copy the bytes of ``source`` (a part written by ``stage``, checked) to ``offset`` of
        upload ``key`` (created if missing), durably if the store fsyncs; ``source`` stays staged (discard it)."""
        raise TypeError(f"{type(self).__name__} writes no parts in place (uploads is False)")

    async def stage_upload(
        self, key: str, target: str, regions: Sequence[Region], total: int, *, algorithm: str | None = None
    ) -> Staged:
        """(``uploads`` stores) Stage upload ``key`` as a version of block ``target`` without copying it: the
        upload must be ``total`` bytes and each region must hash to its digest (else DigestMismatch), and the whole
        is hashed for the version's checksum (in ``algorithm``) and chunk CRCs. The upload itself stays until
        deleted."""
        raise TypeError(f"{type(self).__name__} writes no parts in place (uploads is False)")


@dataclass(frozen=True, slots=True)
class Leftover:
    """A staged version whose writer is gone (``BlockStore.leftovers``): the key it was for, its stamp, and the
    store's own name for it."""

    key: str
    stamp: str
    name: str


@dataclass(frozen=True, slots=True)
class Region:
    """``[start, end)`` of an upload file, whose bytes must hash to ``digest`` (a ``Checksum.token``: one part of
    a multi-part object)."""

    start: int
    end: int
    digest: str


class BodyChecker:
    """Counts and checksums a body as it streams, raising before the store publishes anything that is wrong: the one
    place a body is hashed. It checks the checksum the writer sent (``expected_digest``, a ``Checksum.token``: its
    algorithm is the one computed) or, when none, computes one in ``algorithm``; and it takes the CRC64NVME of each
    chunk (``Chunks``), from which a CRC64NVME of the whole is combined (no second pass over the bytes)."""

    __slots__ = (
        "_chunk",
        "_chunk_crc",
        "_filled",
        "_received",
        "_sha",
        "_sums",
        "_whole",
        "algorithm",
        "expected",
        "size",
    )

    def __init__(self, *, size: int, expected_digest: str | None, algorithm: str | None = None) -> None:
        self.size = size
        self.expected = None if expected_digest is None else parse_checksum_token(expected_digest.lower())
        self.algorithm = self.expected.algorithm if self.expected is not None else algorithm or DEFAULT_ALGORITHM
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {self.algorithm!r}")
        self._sha = hashlib.sha256() if self.algorithm == SHA256 else None
        self._chunk = chunk_bytes_for(size)
        self._chunk_crc = 0
        self._filled = 0
        self._whole = 0
        self._sums = bytearray()
        self._received = 0

    @property
    def expected_digest(self) -> str | None:
        return None if self.expected is None else self.expected.token

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        n = len(chunk)
        self._received += n
        if self._received > self.size:
            raise SizeMismatch(f"body is longer than Content-Length {self.size}")
        if self._sha is not None:
            self._sha.update(chunk)
        if self._filled + n < self._chunk:  # the common case: the piece stays inside the current chunk
            self._chunk_crc = crc64nvme(chunk, self._chunk_crc)
            self._filled += n
            return
        view = memoryview(chunk).cast("B")
        at = 0
        while at < n:
            take = min(n - at, self._chunk - self._filled)
            self._chunk_crc = crc64nvme(view[at : at + take], self._chunk_crc)
            self._filled += take
            at += take
            if self._filled == self._chunk:
                self._close_chunk()

    def _close_chunk(self) -> None:
        self._sums += self._chunk_crc.to_bytes(8, "big")
        self._whole = combine(self._whole, self._chunk_crc, self._filled)
        self._chunk_crc = 0
        self._filled = 0

    def finish(self) -> Version:
        if self._received != self.size:
            raise SizeMismatch(f"body ended after {self._received} of {self.size} bytes")
        if self._filled or not self._sums:  # the last, shorter chunk (or the one chunk of an empty body)
            self._close_chunk()
        if self._sha is not None:
            found = Checksum(SHA256, self._sha.hexdigest())
        else:
            found = Checksum.of(CRC64NVME, self._whole)
        if self.expected is not None and found != self.expected:
            raise DigestMismatch(f"body {found.algorithm} is {found.hex}, the request said {self.expected.hex}")
        return Version(size=self.size, digest=found.token, chunks=Chunks(self._chunk, bytes(self._sums)))


class BodyPieces(list[bytes]):
    """A body all in memory (the PUT lane's, as it arrived): an ``AsyncIterable`` of its pieces like any body, which a
    store may also take whole (the filesystem's ``grouped``), without an async generator per body."""

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _Pieces(iter(self))


class _Pieces:
    __slots__ = ("_it",)

    def __init__(self, it: Iterator[bytes]) -> None:
        self._it = it

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> bytes:
        try:
            return next(self._it)
        except StopIteration:
            raise StopAsyncIteration from None


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
