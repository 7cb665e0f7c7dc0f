"""One BlockStore contract, run against every store: memory, filesystem and S3 (on a moto server and on SeaweedFS)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.config import S3Backend
from app.errors import BlockNotFound, DigestMismatch, SizeMismatch
from app.storage import BlockStore
from app.storage.checksums import checksum_of
from app.storage.filesystem import TEMP_PREFIX, FilesystemStore
from app.storage.memory import MemoryStore
from app.storage.s3 import S3Store
from contract.wire import SHA256
from tests.conftest import crc, random_bytes, sha
from tests.services import S3_CREDS, S3_SERVERS, S3TestServer, unique_bucket

MiB = 1024 * 1024
CHUNK = 64 * 1024
LARGE = 12 * MiB + 12345
"""Over the S3 store's 6 MiB multipart threshold here: three 5 MiB-plus parts; many chunks for every store."""


@pytest.fixture(params=["memory", "fs", "fs-inline", *(f"s3-{server}" for server in S3_SERVERS)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlockStore]:
    kind = request.param
    s: BlockStore
    if kind == "memory":
        s = MemoryStore(chunk_bytes=CHUNK)
    elif kind == "fs":
        s = FilesystemStore(root=tmp_path / "blocks", chunk_bytes=CHUNK)
    elif kind == "fs-inline":  # every write and cached read on the event loop (no fsync, any size inline)
        s = FilesystemStore(root=tmp_path / "blocks", chunk_bytes=CHUNK, fsync=False, inline_bytes=64 * MiB)
    else:
        server: S3TestServer = request.getfixturevalue(f"{kind.removeprefix('s3-')}_server")
        cfg = S3Backend(
            bucket=unique_bucket(),
            prefix="kv",
            endpoint_url=server.url,
            multipart_threshold_bytes=6 * MiB,
            part_bytes=5 * MiB,
            **S3_CREDS,
        )
        s = S3Store(cfg=cfg, chunk_bytes=CHUNK)
    await s.start()
    try:
        yield s
    finally:
        await s.close()


async def leftovers(store: BlockStore) -> int:
    """Temporary data an interrupted write left behind: temp files, or open multipart uploads."""
    if isinstance(store, FilesystemStore):
        return sum(1 for _, _, files in os.walk(store.root) for f in files if f.startswith(TEMP_PREFIX))
    if isinstance(store, S3Store):
        resp = await store.client.list_multipart_uploads(Bucket=store.bucket)
        return len(resp.get("Uploads", []))
    return 0


async def pieces(data: bytes, *, piece: int = 100_003) -> AsyncIterator[bytes]:
    """The body as a network would deliver it: uneven pieces."""
    for pos in range(0, len(data), piece):
        yield data[pos : pos + piece]


async def failing(data: bytes, *, after: int) -> AsyncIterator[bytes]:
    yield data[:after]
    raise RuntimeError("client went away")


async def read(store: BlockStore, key: str, start: int = 0, end: int | None = None) -> bytes:
    reader = await store.open(key)
    try:
        return b"".join([c async for c in reader.chunks(start=start, end=reader.size if end is None else end)])
    finally:
        await reader.aclose()


async def test_reader_is_an_async_context_manager(store: BlockStore) -> None:
    """``async with await store.open(key) as reader``: the reader reads inside and is released on the way out, also
    when the block inside fails (the filesystem's file descriptor is closed)."""
    data = random_bytes(200_000, 7)
    await put(store, KEY, data)
    fds = len(os.listdir("/proc/self/fd"))
    async with await store.open(KEY) as reader:
        assert b"".join([c async for c in reader.chunks(start=0, end=reader.size)]) == data
    with pytest.raises(RuntimeError, match="stop"):
        async with await store.open(KEY) as reader:
            raise RuntimeError("stop")
    if isinstance(store, FilesystemStore):  # S3's pool may open a connection meanwhile: only files are counted
        assert len(os.listdir("/proc/self/fd")) == fds


async def put(store: BlockStore, key: str, data: bytes, *, digest: str | None = None) -> None:
    meta = await store.put(key, pieces(data), size=len(data), expected_digest=digest)
    assert (meta.size, meta.digest) == (len(data), digest or crc(data))  # unannounced: the default, CRC64NVME


KEY = "ns_0123456789ab_r0/abc/de_g0/abcdef.bin"


async def test_put_open_head_digest(store: BlockStore) -> None:
    data = random_bytes(300_000, 1)
    await put(store, KEY, data, digest=sha(data))
    assert await store.head(KEY) == len(data)
    reader = await store.open(KEY)
    assert reader.size == len(data)
    await reader.aclose()
    assert await read(store, KEY) == data
    meta = await store.digest(KEY)
    assert (meta.size, meta.digest) == (len(data), crc(data))
    assert meta.chunks is not None and meta.chunks.whole(len(data)) == checksum_of(data).crc
    assert (await store.digest(KEY, algorithm=SHA256)).digest == sha(data)


@pytest.mark.parametrize(
    ("start", "end"), [(0, 1), (1, 10), (CHUNK - 1, CHUNK + 1), (5, 3 * CHUNK + 17), (299_999, 300_000), (0, 300_000)]
)
async def test_ranges(store: BlockStore, start: int, end: int) -> None:
    data = random_bytes(300_000, 2)
    await put(store, KEY, data)
    assert await read(store, KEY, start, end) == data[start:end]


async def test_misses_are_values(store: BlockStore) -> None:
    assert await store.head(KEY) is None
    with pytest.raises(BlockNotFound):
        await store.open(KEY)
    with pytest.raises(BlockNotFound):
        await store.digest(KEY)
    assert await store.delete(KEY) is False


async def test_delete(store: BlockStore) -> None:
    await put(store, KEY, b"x" * 1000)
    assert await store.delete(KEY) is True
    assert await store.head(KEY) is None
    with pytest.raises(BlockNotFound):
        await store.open(KEY)
    assert await store.delete(KEY) is False


async def test_list(store: BlockStore) -> None:
    keys = {"a_1_r0/000/00_g0/1.bin": 10, "a_1_r0/001/00_g0/2.bin": 20, "b_2_r0/000/00_g0/3.bin": 0}
    for key, n in keys.items():
        await put(store, key, random_bytes(n, n))
    listed = {i.key: i.size async for i in store.list()}
    assert listed == keys
    under_a = {i.key: i.size async for i in store.list("a_1_r0/")}
    assert under_a == {k: v for k, v in keys.items() if k.startswith("a_1_r0/")}
    assert [i async for i in store.list("c_")] == []
    await store.delete("a_1_r0/000/00_g0/1.bin")
    assert {i.key async for i in store.list("a_")} == {"a_1_r0/001/00_g0/2.bin"}


async def test_overwrite(store: BlockStore) -> None:
    old, new = random_bytes(5000, 3), random_bytes(7777, 4)
    await put(store, KEY, old)
    await put(store, KEY, new)
    assert await store.head(KEY) == len(new)
    assert await read(store, KEY) == new
    assert (await store.digest(KEY)).digest == crc(new)
    assert [i.key async for i in store.list()] == [KEY]


async def test_empty_object(store: BlockStore) -> None:
    meta = await store.put(KEY, pieces(b""), size=0)
    assert (meta.size, meta.digest) == (0, crc(b""))
    assert await store.head(KEY) == 0
    assert await read(store, KEY) == b""
    assert (await store.digest(KEY)).digest == crc(b"")


@pytest.mark.parametrize("announce", [True, False])
async def test_large_multi_chunk(store: BlockStore, announce: bool) -> None:
    data = random_bytes(LARGE, 5)
    await put(store, KEY, data, digest=sha(data) if announce else None)
    assert await store.head(KEY) == LARGE
    got = await read(store, KEY)
    assert len(got) == LARGE and got == data
    assert await read(store, KEY, 5 * MiB - 3, 10 * MiB + 3) == data[5 * MiB - 3 : 10 * MiB + 3]
    assert (await store.digest(KEY)).digest == crc(data)
    assert await leftovers(store) == 0


def _bad_bodies(data: bytes) -> dict[str, tuple[object, int, str | None, type[BaseException]]]:
    """name -> (body, announced size, announced digest, expected error)."""
    n = len(data)
    return {
        "iterator_fails": (failing(data, after=n // 2 + 1), n, None, RuntimeError),
        "short": (pieces(data[:-1]), n, None, SizeMismatch),
        "long": (pieces(data + b"!"), n, None, SizeMismatch),
        "digest": (pieces(data), n, sha(data + b"?"), DigestMismatch),
        "crc": (pieces(data), n, crc(data + b"?"), DigestMismatch),
    }


@pytest.mark.parametrize(
    ("failure", "size"),
    [(f, 70_000) for f in ("iterator_fails", "short", "long", "digest", "crc")]
    + [(f, LARGE) for f in ("iterator_fails", "long", "digest", "crc")],  # LARGE: S3's multipart path
)
async def test_failed_put_publishes_nothing(store: BlockStore, size: int, failure: str) -> None:
    data = random_bytes(size, 6)
    body, n, digest, error = _bad_bodies(data)[failure]
    with pytest.raises(error):
        await store.put(KEY, body, size=n, expected_digest=digest)  # type: ignore[arg-type]
    assert await store.head(KEY) is None
    assert [i async for i in store.list()] == []
    assert await leftovers(store) == 0


@pytest.mark.parametrize("failure", ["iterator_fails", "short", "long", "digest"])
async def test_failed_overwrite_keeps_old(store: BlockStore, failure: str) -> None:
    old = random_bytes(3000, 7)
    await put(store, KEY, old)
    body, n, digest, error = _bad_bodies(random_bytes(LARGE if failure == "digest" else 9000, 8))[failure]
    with pytest.raises(error):
        await store.put(KEY, body, size=n, expected_digest=digest)  # type: ignore[arg-type]
    assert await store.head(KEY) == len(old)
    assert await read(store, KEY) == old
    assert await leftovers(store) == 0


async def test_cancelled_put_publishes_nothing(store: BlockStore) -> None:
    data = random_bytes(LARGE, 9)
    reached = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield data[: 5 * MiB]
        yield data[5 * MiB : 10 * MiB + 1]
        reached.set()
        await asyncio.Event().wait()
        yield b""  # never reached

    task = asyncio.create_task(store.put(KEY, stalls(), size=len(data)))
    await reached.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.head(KEY) is None
    assert await leftovers(store) == 0
