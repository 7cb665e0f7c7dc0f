"""The filesystem store hands the kernel at most ``WRITE_CALL_BYTES`` per write call: a 2 MiB block written in one
call costs several times two 1 MiB calls on a VM whose free memory goes back to its host (fs_files.WRITE_CALL_BYTES,
``python -m benchmarks.primitives.write_calls``)."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.storage import fs_files
from app.storage.base import BodyPieces
from app.storage.filesystem import FilesystemStore
from app.storage.fs_files import WRITE_CALL_BYTES, write_all
from tests.conftest import QUICK

MiB = 1024 * 1024


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte count of every writev/pwritev call made (the real calls, made as asked)."""
    seen: list[int] = []
    writev, pwritev = os.writev, os.pwritev

    def spy_writev(fd: int, buffers: Any) -> int:
        seen.append(sum(len(b) for b in buffers))
        return writev(fd, buffers)

    def spy_pwritev(fd: int, buffers: Any, offset: int) -> int:
        seen.append(sum(len(b) for b in buffers))
        return pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "writev", spy_writev)
    monkeypatch.setattr(os, "pwritev", spy_pwritev)
    return seen


@pytest.mark.parametrize("piece", [2 * MiB, 256 * 1024, 65536 + 7, 1])
@pytest.mark.parametrize("lane", [True, False])
async def test_a_2_mib_block_goes_down_in_calls_of_at_most_1_mib(
    tmp_path: Path, calls: list[int], piece: int, lane: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = WRITE_CALL_BYTES
    if piece == 1 and QUICK:  # the quick loop: the same coalescing of one-byte pieces, under a 64 KiB cap
        cap = 65536
        monkeypatch.setattr(fs_files, "WRITE_CALL_BYTES", cap)
    store = FilesystemStore(root=tmp_path, fsync=False)
    data = random.Random(piece).randbytes(2 * MiB + 4096 if piece > 1 else 3 * cap // 2)
    pieces = [data[i : i + piece] for i in range(0, len(data), piece)]

    async def stream() -> AsyncIterator[bytes]:
        for p in pieces:
            yield p

    meta = await store.put("k/a", BodyPieces(pieces) if lane else stream(), size=len(data))
    assert meta.size == len(data)
    assert store.path_of("k/a").read_bytes() == data
    assert calls and max(calls) <= cap
    assert sum(calls) == len(data)


@pytest.mark.parametrize("seed", range(30))
def test_write_all_writes_every_byte_in_order_at_either_position(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(fs_files, "WRITE_CALL_BYTES", rng.choice([1, 5, 64, 1000]))
    pieces = [rng.randbytes(rng.choice([0, 1, 3, 64, 700])) for _ in range(rng.choice([0, 1, 2, 9, 40]))]
    data = b"".join(pieces)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        write_all(fd, pieces, None)
        write_all(fd, pieces, len(data) + 10)
    finally:
        os.close(fd)
    got = (tmp_path / "f").read_bytes()
    assert got[: len(data)] == data
    assert got[len(data) + 10 :] == data
