"""The version abilities of the BlockStore protocol, run against every store (memory, filesystem, S3 on moto and on
SeaweedFS): staged versions are invisible until published, stamps name one version each, removal takes only the
version named, and the recovery abilities (roll forward, leftovers, claim, restamp) keep what they declare, whether a
store implements them or keeps the protocol's do-nothing defaults."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from app.errors import BlockNotFound, VersionMismatch
from app.storage import BlockStore
from app.storage.base import Staged
from tests.conftest import crc, key_for, random_bytes
from tests.contract.test_store_contract import store  # noqa: F401  (the fixture: every store)

KEY = key_for(4242)


async def body(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def stage(store: BlockStore, data: bytes, key: str = KEY) -> Staged:  # noqa: F811
    return await store.stage(key, body(data), size=len(data))


async def read_version(store: BlockStore, stamp: str) -> bytes:  # noqa: F811
    """The bytes of version ``stamp`` of KEY, opened as the core opens a block: by the stamp its row names."""
    async with await store.open(KEY, stamp=stamp) as reader:
        return b"".join([c async for c in reader.chunks(start=0, end=reader.size)])


async def test_a_staged_version_is_invisible_until_published(store: BlockStore) -> None:  # noqa: F811
    data = random_bytes(5000, 1)
    staged = await stage(store, data)
    assert staged.meta.size == 5000 and staged.meta.digest == crc(data) and staged.stamp
    if not store.versioned:  # a versioned store's row names the object: it is readable by its stamp at once
        with pytest.raises(BlockNotFound):
            await store.open(KEY)
    await store.publish(staged)
    assert await read_version(store, staged.stamp) == data
    assert await store.has_version(KEY, staged.stamp)
    listed = [info async for info in store.list() if info.key == KEY]
    assert [info.stamp for info in listed] == [staged.stamp]


async def test_each_stamp_names_one_version(store: BlockStore) -> None:  # noqa: F811
    first = await stage(store, random_bytes(3000, 2))
    await store.publish(first)
    second = await stage(store, random_bytes(3000, 3))
    await store.publish(second)
    assert first.stamp != second.stamp
    assert await store.has_version(KEY, second.stamp)
    reader = await store.open(KEY, stamp=second.stamp)
    await reader.aclose()
    if store.versioned:  # both objects exist until the first is retired
        assert await store.has_version(KEY, first.stamp)
    else:
        assert not await store.has_version(KEY, first.stamp)
        with pytest.raises(VersionMismatch):
            await store.open(KEY, stamp=first.stamp)


async def test_remove_takes_only_the_version_named(store: BlockStore) -> None:  # noqa: F811
    old = await stage(store, random_bytes(2000, 4))
    await store.publish(old)
    new = await stage(store, random_bytes(2000, 5))
    await store.publish(new)
    await store.remove(KEY, stamp=old.stamp)
    assert await store.has_version(KEY, new.stamp)  # the version under the key stays
    assert await store.remove(KEY, stamp=new.stamp)
    assert not await store.has_version(KEY, new.stamp)


async def test_a_discarded_version_leaves_nothing(store: BlockStore) -> None:  # noqa: F811
    staged = await stage(store, random_bytes(2000, 6))
    await store.discard(staged)
    assert not await store.has_version(KEY, staged.stamp)
    assert [info async for info in store.list() if info.key == KEY] == []
    assert list(await store.leftovers()) == []


async def test_a_released_version_is_left_for_recovery(store: BlockStore) -> None:  # noqa: F811
    """A staged version let go of with its commit's outcome unknown (``release``) stays where recovery finds it:
    published by ``roll_forward`` when the row names it (on S3 the row names the object itself)."""
    data = random_bytes(3000, 9)
    staged = await stage(store, data)
    await store.release(staged)
    if not store.versioned:
        assert not await store.has_version(KEY, staged.stamp)  # not published by the release
        assert await store.roll_forward(KEY, staged.stamp)
    assert await store.has_version(KEY, staged.stamp)
    async with await store.open(KEY, stamp=staged.stamp) as reader:
        assert b"".join([bytes(c) async for c in reader.chunks(start=0, end=len(data))]) == data


async def test_recovery_abilities_keep_what_they_declare(store: BlockStore) -> None:  # noqa: F811
    data = random_bytes(4000, 7)
    staged = await stage(store, data)
    await store.publish(staged)
    # nothing staged is left behind, so there is nothing to roll forward or to sweep
    assert not await store.roll_forward(KEY, staged.stamp)
    assert list(await store.leftovers()) == []
    # claim: the data under the key, hashed, with a stamp that names it
    claimed = await store.claim(KEY) if not store.versioned else None
    if claimed is not None:
        assert (claimed.size, claimed.digest) == (4000, crc(data))
        assert claimed.stamp is not None and await store.has_version(KEY, claimed.stamp)
        assert store.issued(claimed.stamp)
    assert store.issued(staged.stamp)
    # restamp refuses a stamp that does not name the version there
    assert await store.restamp(KEY, stamp="not-a-stamp-of-this-version") is None
    assert await store.remove_empty_dirs("_parts/", older_than_s=0) >= 0


async def test_open_now_gives_only_the_version_named(store: BlockStore) -> None:  # noqa: F811
    """``open_now`` (the GET lane's: a local file to send as it is) opens exactly the version named, at its size, or
    nothing: a store without local files keeps the default (None), as does the filesystem with inline file calls off
    (network storage: an open may wait); the filesystem with them on, a descriptor of those bytes."""
    import os

    from app.storage.filesystem import FilesystemStore

    first = await stage(store, random_bytes(3000, 7))
    await store.publish(first)
    second = await stage(store, random_bytes(4000, 8))
    await store.publish(second)
    fd = store.open_now(KEY, stamp=second.stamp, size=4000)
    if not isinstance(store, FilesystemStore) or store._inline == 0:
        assert fd is None
        return
    assert fd is not None
    try:
        assert os.pread(fd, 5000, 0) == random_bytes(4000, 8)
    finally:
        os.close(fd)
    assert store.open_now(KEY, stamp=first.stamp, size=3000) is None  # replaced
    assert store.open_now(KEY, stamp=second.stamp, size=3999) is None  # not its size
    assert store.open_now(key_for(4243), stamp=second.stamp, size=4000) is None  # a miss


async def test_quarantine_takes_the_version_out_of_every_read_and_listing(store: BlockStore) -> None:  # noqa: F811
    """Bytes judged corrupt are moved aside before their row goes: not readable, not listed (so never adopted),
    and only the version named (another stamp is refused)."""
    staged = await stage(store, random_bytes(3000, 8))
    await store.publish(staged)
    assert not await store.quarantine(KEY, stamp="0" * 32 + ".1") or store.versioned  # not that version: kept
    assert await store.has_version(KEY, staged.stamp)
    assert await store.quarantine(KEY, stamp=staged.stamp)
    assert not await store.has_version(KEY, staged.stamp)
    assert [info async for info in store.list() if info.key == KEY] == []
    assert list(await store.leftovers()) == []


async def test_clear_removes_whatever_the_key_holds_and_the_staged_version_named(store: BlockStore) -> None:  # noqa: F811
    """A crash between a commit and its publication: the row names a staged version, the key holds the older one.
    Clearing the key (its row gone) leaves nothing for recovery to adopt or roll forward."""
    old = await stage(store, random_bytes(3000, 9))
    await store.publish(old)
    committed = await stage(store, random_bytes(3000, 10))  # never published: the crash
    if hasattr(committed.handle, "close"):
        committed.handle.close()  # its writer is gone (the filesystem's lock on the staged file goes with it)
    if store.versioned:
        await store.publish(committed)  # S3: publishing is nothing; removal there retires by the row's stamp
        return
    assert await store.clear(KEY, stamp=committed.stamp)
    assert [info async for info in store.list() if info.key == KEY] == []
    assert not await store.roll_forward(KEY, committed.stamp)
    assert list(await store.leftovers()) == []
    assert not await store.clear(KEY, stamp=committed.stamp)  # nothing left
