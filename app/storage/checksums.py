"""Computing checksums (``BodyChecker`` in app/storage/base.py is where a body is hashed; this module is its
arithmetic), and the chunk checksums that let any byte range be verified without reading the object.

CRC64NVME comes from ``awscrt`` (the AWS common runtime: a wheel, the library botocore itself uses for S3's
checksums), which runs at memory speed, many times hashlib's sha256 (docs/checksums.md has the figures), and can
*combine* CRCs: ``crc(A || B)`` from ``crc(A)``, ``crc(B)`` and ``len(B)``, without the bytes.

**Chunks.** While a version's body arrives, the CRC64NVME of each ``chunk_bytes`` piece of it is computed too (the
grid of ``chunk_bytes_for(size)``), and kept in the version's index row. A Range GET then vouches for exactly the
bytes asked for: the CRC of the range is combined from the recorded CRCs of the chunks it covers, and only a chunk
that the range cuts is read (and checked against its recorded CRC) to get the CRC of its piece. The chunk CRCs of a
CRC64NVME version combine to its checksum, so they cannot disagree with what the writer sent.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from awscrt import checksums as _crt

from contract.wire import CRC64NVME, DEFAULT_ALGORITHM, SHA256, Checksum, parse_checksum_token

Buffer = bytes | bytearray | memoryview

MIN_CHUNK_BYTES = 64 * 1024
"""The smallest chunk: a range's cut chunks cost at most this much reading each, for small objects."""
MAX_CHUNKS = 128
"""The most chunks a version has: 8 bytes each, 1 KiB in its row at most."""


def crc64nvme(data: Buffer, previous: int = 0) -> int:
    """CRC64NVME of ``data``, continuing ``previous`` (the CRC of the bytes before it)."""
    return int(_crt.crc64nvme(data, previous))


def combine(first: int, second: int, second_len: int) -> int:
    """The CRC64NVME of ``A || B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``."""
    if second_len == 0:
        return first
    return int(_crt.combine_crc64nvme(first, second, second_len))


def chunk_bytes_for(size: int) -> int:
    """The chunk size of a ``size``-byte version: a power of two, at least 64 KiB, at most 128 chunks."""
    chunk = MIN_CHUNK_BYTES
    while chunk * MAX_CHUNKS < size:
        chunk *= 2
    return chunk


@dataclass(frozen=True, slots=True)
class Chunks:
    """The CRC64NVME of each ``size``-byte chunk of a version (the last may be shorter), 8 bytes each, big-endian."""

    size: int
    sums: bytes

    def __post_init__(self) -> None:
        if self.size <= 0 or len(self.sums) % 8:
            raise ValueError(f"not chunk checksums: size {self.size}, {len(self.sums)} bytes of sums")

    def __len__(self) -> int:
        return len(self.sums) // 8

    def crc(self, index: int) -> int:
        return int.from_bytes(self.sums[8 * index : 8 * index + 8], "big")

    def fits(self, total: int) -> bool:
        """These are the chunks of a ``total``-byte object."""
        return len(self) == max(1, -(-total // self.size))

    def whole(self, total: int) -> int:
        """The CRC64NVME of the whole ``total``-byte object they cover."""
        crc = 0
        for i in range(len(self)):
            crc = combine(crc, self.crc(i), min(self.size, total - i * self.size))
        return crc


class Hasher:
    """A running checksum in one algorithm."""

    __slots__ = ("_crc", "_sha", "algorithm")

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self._crc = 0
        self._sha = hashlib.sha256() if algorithm == SHA256 else None
        if algorithm not in (SHA256, CRC64NVME):
            raise ValueError(f"unknown checksum algorithm {algorithm!r}")

    def update(self, data: Buffer) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = crc64nvme(data, self._crc)

    def result(self) -> Checksum:
        if self._sha is not None:
            return Checksum(SHA256, self._sha.hexdigest())
        return Checksum.of(CRC64NVME, self._crc)


def checksum_of(data: Buffer, algorithm: str = DEFAULT_ALGORITHM) -> Checksum:
    hasher = Hasher(algorithm)
    hasher.update(data)
    return hasher.result()


def algorithm_of(token: str) -> str:
    """The algorithm of a checksum token (``Checksum.token``: bare hex is a sha256)."""
    return parse_checksum_token(token).algorithm
