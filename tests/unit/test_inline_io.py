"""The filesystem store's file calls that cannot wait on the disk run on the event loop, not a worker thread.

A worker-thread hop costs more CPU than a small write or a page-cache read (``python -m benchmarks.gateway.cost``): a
version's writes, rename and discard run inline when the store does not fsync and the body is at most
``inline_bytes``; reads run inline only when the page cache holds the bytes (``RWF_NOWAIT``), and go to a thread
when it does not or when the filesystem cannot tell. The answers are the same bytes either way.
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.storage import fs_files
from app.storage.filesystem import FilesystemStore
from app.threads import Threads, threads
from tests.conftest import random_bytes

KiB = 1024
KEY = "ns/000/10_g0/" + "ab" * 32 + ".bin"


@pytest.fixture
def hops(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the calls this process's pool ran on a worker thread."""
    seen: list[str] = []
    pool = threads()
    real = Threads.run

    async def counting(self: Threads, fn: Any, *args: Any) -> Any:
        seen.append(getattr(fn, "__name__", repr(fn)))
        return await real(self, fn, *args)

    monkeypatch.setattr(pool, "run", counting.__get__(pool, Threads))
    yield seen


async def body(data: bytes, piece: int = 16 * KiB) -> AsyncIterator[bytes]:
    for at in range(0, len(data), piece):
        yield data[at : at + piece]


async def put_and_read(store: FilesystemStore, data: bytes) -> bytes:
    staged = await store.stage(KEY, body(data), size=len(data))
    await store.publish(staged)
    async with await store.open(KEY, stamp=staged.stamp) as reader:
        return b"".join([bytes(c) async for c in reader.chunks(start=0, end=reader.size)])


async def test_a_small_write_without_fsync_and_a_cached_read_take_no_thread(tmp_path: Path, hops: list[str]) -> None:
    data = random_bytes(64 * KiB, seed=1)
    store = FilesystemStore(root=tmp_path, fsync=False, inline_bytes=64 * KiB, chunk_bytes=24 * KiB)
    await store.start()
    hops.clear()  # start-up's own calls (the data root's probe) are not the data path
    assert await put_and_read(store, data) == data
    assert hops == []


@pytest.mark.parametrize(
    ("fsync", "inline_bytes", "size"),
    [(True, 4 * 1024 * KiB, 64 * KiB), (False, 64 * KiB - 1, 64 * KiB), (False, 0, 64 * KiB)],
    ids=["fsync", "over-the-bound", "off"],
)
async def test_a_write_that_may_wait_goes_to_a_thread(
    tmp_path: Path, hops: list[str], fsync: bool, inline_bytes: int, size: int
) -> None:
    data = random_bytes(size, seed=2)
    store = FilesystemStore(root=tmp_path, fsync=fsync, inline_bytes=inline_bytes)
    await store.start()
    hops.clear()
    assert await put_and_read(store, data) == data
    assert "step" in hops and "rename" in hops  # the staged file's writes and its publish
    assert ("pread" in hops) is (inline_bytes == 0)  # reads of cached bytes stay inline unless inline is off


async def test_a_read_the_page_cache_cannot_serve_goes_to_a_thread(
    tmp_path: Path, hops: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random_bytes(100 * KiB, seed=3)
    store = FilesystemStore(root=tmp_path, fsync=False, inline_bytes=1024 * KiB, chunk_bytes=32 * KiB)
    real = os.preadv
    calls: list[int] = []

    def not_cached(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags & os.RWF_NOWAIT:
            calls.append(offset)
            if offset >= 32 * KiB:  # the first chunk is cached, the rest would wait on the disk
                raise BlockingIOError(errno.EAGAIN, "would block")
        return real(fd, buffers, offset, flags)

    await store.start()
    monkeypatch.setattr(os, "preadv", not_cached)
    assert await put_and_read(store, data) == data
    assert calls == [0, 32 * KiB, 64 * KiB, 96 * KiB]
    assert hops.count("pread") == 3


async def test_a_partly_cached_read_continues_where_the_cache_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random_bytes(80 * KiB, seed=4)
    store = FilesystemStore(root=tmp_path, fsync=False, inline_bytes=1024 * KiB, chunk_bytes=64 * KiB)
    real = os.preadv

    def short(fd: int, buffers: list[bytearray], offset: int, flags: int = 0) -> int:
        if flags & os.RWF_NOWAIT:  # only 5000 bytes are in the cache at each call
            view = memoryview(buffers[0])[:5000]
            return real(fd, [view], offset, flags)
        return real(fd, buffers, offset, flags)

    await store.start()
    monkeypatch.setattr(os, "preadv", short)
    assert await put_and_read(store, data) == data


async def test_a_filesystem_that_refuses_nonblocking_reads_reads_on_threads(
    tmp_path: Path, hops: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random_bytes(48 * KiB, seed=5)
    store = FilesystemStore(root=tmp_path, fsync=False, inline_bytes=1024 * KiB, chunk_bytes=16 * KiB)
    refused: list[int] = []

    def refuse(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        refused.append(offset)
        raise OSError(errno.EOPNOTSUPP, "not supported")

    await store.start()
    monkeypatch.setattr(os, "preadv", refuse)
    monkeypatch.setattr(fs_files, "_nowait", True)
    assert await put_and_read(store, data) == data
    assert refused == [0]  # asked once, then every read went to a thread
    assert hops.count("pread") == 3
    assert fs_files._nowait is False


async def test_an_io_error_of_an_inline_read_is_the_stores_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.errors import BackendUnavailable

    store = FilesystemStore(root=tmp_path, fsync=False, inline_bytes=1024 * KiB)
    data = random_bytes(8 * KiB, seed=6)
    await store.start()
    staged = await store.stage(KEY, body(data), size=len(data))
    await store.publish(staged)

    def broken(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", broken)
    async with await store.open(KEY) as reader:
        with pytest.raises(BackendUnavailable, match="read: Input/output error"):
            [c async for c in reader.chunks(start=0, end=reader.size)]


async def test_the_get_lanes_open_probes_the_page_cache_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``open_now`` (the GET lane's open: its answer goes out by ``sendfile`` on the event loop) asks the page cache
    once, at the file's first byte, the page LRU ages out first: a probe is a syscall per GET, and a heuristic
    (what it does not see, ``sendfile`` reads from the disk); the stamp is the integrity check, not the probe."""
    data = random_bytes(64 * KiB, seed=7)
    store = FilesystemStore(root=tmp_path, fsync=False, inline_bytes=1024 * KiB)
    await store.start()
    staged = await store.stage(KEY, body(data), size=len(data))
    await store.publish(staged)
    real = os.preadv
    probes: list[int] = []
    uncached: set[int] = set()

    def probing(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags & os.RWF_NOWAIT:
            probes.append(offset)
            if offset in uncached:
                raise BlockingIOError(errno.EAGAIN, "would block")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", probing)
    fd = store.open_now(KEY, stamp=staged.stamp, size=len(data))
    assert fd is not None
    try:
        assert os.pread(fd, len(data), 0) == data
    finally:
        os.close(fd)
    assert probes == [0]

    probes.clear()
    uncached.add(0)  # the first page gone: the stack's reader serves it (a thread where the cache cannot)
    assert store.open_now(KEY, stamp=staged.stamp, size=len(data)) is None
    assert probes == [0]
