"""Checksums: the wire grammar (contract/wire.py), CRC64NVME and its combination, the chunk grid, BodyChecker."""

from __future__ import annotations

import base64
import hashlib
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.errors import DigestMismatch, SizeMismatch
from app.storage.base import BodyChecker
from app.storage.checksums import MAX_CHUNKS, MIN_CHUNK_BYTES, Chunks, checksum_of, chunk_bytes_for, combine, crc64nvme
from contract import wire
from contract.wire import CRC64NVME, SHA256, Checksum, MalformedHeader


def test_crc64nvme_check_value_and_its_three_spellings() -> None:
    assert crc64nvme(b"123456789") == 0xAE8B14860A799888  # CRC-64/NVME's check value (the RevEng catalogue)
    c = checksum_of(b"123456789")
    assert c == Checksum(CRC64NVME, "ae8b14860a799888")
    assert c.header == "crc64nvme=rosUhgp5mIg=" == f"crc64nvme={base64.b64encode(c.raw).decode()}"
    assert c.token == "crc64nvme:ae8b14860a799888" and c.etag == '"crc64nvme:ae8b14860a799888"'
    assert wire.parse_checksum(c.header) == c == wire.parse_checksum_token(c.token) == wire.etag_checksum(c.etag)
    sha = checksum_of(b"x", SHA256)
    assert sha.token == hashlib.sha256(b"x").hexdigest()  # a sha256 token is bare hex, as every row before 0005
    assert wire.parse_checksum_token(sha.token) == sha == wire.parse_checksum(sha.header)


@pytest.mark.parametrize(
    "value",
    [
        "crc64nvme",
        "crc64nvme=",
        "md5=AAAAAAAAAAA=",  # unknown algorithm
        "crc64nvme=AAAAAAAAAAAAAAA=",  # 11 bytes
        "sha256=AAAAAAAAAAA=",  # 8 bytes for a sha256
        "crc64nvme=AAAA AAAAAAA=",
        "crc64nvme=²AAAAAAAAAA=",
        "CRC64NVME=AAAAAAAAAAA=",
        "crc64nvme=AAAAAAAAAAA=; sha256=x",
        "crc64nvme:0000000000000000",  # a token is not a header
    ],
)
def test_malformed_checksum_headers_are_refused(value: str) -> None:
    with pytest.raises(MalformedHeader):
        wire.parse_checksum(value)


def test_the_checksum_of_a_put_and_earlier_clients() -> None:
    data = b"block"
    sha = hashlib.sha256(data).hexdigest()
    assert wire.parse_request_checksum(None, None) is None
    assert wire.parse_request_checksum(None, sha.upper()) == Checksum(SHA256, sha)
    both = wire.parse_request_checksum(checksum_of(data, SHA256).header, sha)
    assert both == Checksum(SHA256, sha)
    with pytest.raises(MalformedHeader, match="disagree"):
        wire.parse_request_checksum(checksum_of(data).header, sha)
    with pytest.raises(MalformedHeader):
        wire.parse_request_checksum(None, "xyz")


def test_a_non_sha256_etag_is_never_mistaken_for_one() -> None:
    token = checksum_of(b"a").token
    assert not (len(token) == 64 and all(ch in "0123456789abcdef" for ch in token))
    assert wire.etag_checksum('W/"abc"') is None and wire.etag_checksum('"not-a-checksum"') is None
    with pytest.raises(ValueError):
        Checksum(CRC64NVME, "00" * 32)  # a sha256's length under another name


@given(st.binary(max_size=2000), st.binary(max_size=2000))
def test_crc_combination(a: bytes, b: bytes) -> None:
    assert combine(crc64nvme(a), crc64nvme(b), len(b)) == crc64nvme(a + b)
    assert crc64nvme(b, crc64nvme(a)) == crc64nvme(a + b)


def test_the_chunk_grid() -> None:
    assert chunk_bytes_for(0) == chunk_bytes_for(MIN_CHUNK_BYTES * MAX_CHUNKS) == MIN_CHUNK_BYTES
    assert chunk_bytes_for(MIN_CHUNK_BYTES * MAX_CHUNKS + 1) == 2 * MIN_CHUNK_BYTES
    for size in (1, 2 << 20, 64 << 20, 256 << 20, (1 << 30) + 3):
        step = chunk_bytes_for(size)
        assert -(-size // step) <= MAX_CHUNKS and step & (step - 1) == 0


@pytest.mark.parametrize("size", [0, 1, MIN_CHUNK_BYTES - 1, MIN_CHUNK_BYTES, 3 * MIN_CHUNK_BYTES + 5, 9 << 20])
@pytest.mark.parametrize("algorithm", [CRC64NVME, SHA256])
def test_body_checker_chunks_and_whole(size: int, algorithm: str) -> None:
    rng = random.Random(size)
    data = rng.randbytes(size)
    checker = BodyChecker(size=size, expected_digest=checksum_of(data, algorithm).token)
    pos = 0
    while pos < size:  # network-sized pieces that straddle chunk boundaries
        n = rng.randint(1, 200_000)
        checker.update(memoryview(data)[pos : pos + n])
        pos += n
    meta = checker.finish()
    assert meta.size == size and meta.digest == checksum_of(data, algorithm).token
    chunks = meta.chunks
    assert isinstance(chunks, Chunks) and chunks.size == chunk_bytes_for(size) and chunks.fits(size)
    for i in range(len(chunks)):
        assert chunks.crc(i) == crc64nvme(data[i * chunks.size : (i + 1) * chunks.size])
    assert chunks.whole(size) == crc64nvme(data)


def test_body_checker_refuses_what_is_not_the_body() -> None:
    data = b"x" * 100
    wrong = BodyChecker(size=100, expected_digest=checksum_of(b"y" * 100).token)
    wrong.update(data)
    with pytest.raises(DigestMismatch):
        wrong.finish()
    short = BodyChecker(size=101, expected_digest=None)
    short.update(data)
    with pytest.raises(SizeMismatch):
        short.finish()
    with pytest.raises(SizeMismatch):
        BodyChecker(size=99, expected_digest=None).update(data)
