"""``BodyPieces``: a body all in memory (the PUT lane's) that the filesystem store takes whole (``grouped``), grouped as
a stream is (``batched``)."""

from __future__ import annotations

import random

import pytest

from app.storage.base import BodyPieces
from app.storage.fs_files import batched, grouped


async def _batched(pieces: list[bytes], chunk_bytes: int) -> list[list[bytes]]:
    return [group async for group in batched(BodyPieces(pieces), chunk_bytes=chunk_bytes)]


@pytest.mark.parametrize("seed", range(40))
async def test_groups_are_the_stream_s_groups(seed: int) -> None:
    rng = random.Random(seed)
    chunk = rng.choice([1, 7, 64, 1000, 4096])
    count = rng.choice([0, 1, 2, 5, 600])
    pieces = [rng.randbytes(rng.choice([0, 1, 3, 64, 700])) for _ in range(count)]
    body = BodyPieces(pieces)
    groups = grouped(body, chunk_bytes=chunk)
    streamed = await _batched(pieces, chunk)
    # the same bytes in the same groups (a body under one chunk is taken as it is: an empty piece may stay in it)
    assert [b"".join(g) for g in groups if any(g)] == [b"".join(g) for g in streamed]
    assert b"".join(b"".join(g) for g in groups) == b"".join(pieces)
    assert all(len(g) <= 512 for g in groups) and len(groups) >= 1
    assert [p async for p in body] == pieces  # still a body like any other


def test_an_empty_body_is_one_empty_group() -> None:
    assert grouped(BodyPieces([]), chunk_bytes=4) == [[]]
    assert grouped(BodyPieces([b""]), chunk_bytes=4) == [[b""]]
