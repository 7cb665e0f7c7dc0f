"""Directories made on the way to a block are fsynced in their parents, once (app/storage/fs_files.py
``make_dirs``). A power loss cannot be simulated here: the fsync calls are counted through a wrapper of
``os.fsync`` that records which directory each one was for, on a real filesystem."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.storage.filesystem import FilesystemStore

KEY = "ns_r0/000/10_g0/" + "ab" * 32 + ".bin"
OTHER = "ns_r0/000/10_g0/" + "cd" * 32 + ".bin"


async def body(data: bytes) -> AsyncIterator[bytes]:
    yield data


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Each fsync'd directory's path -> how many times (files are not counted)."""
    seen: Counter[str] = Counter()
    real = os.fsync

    def counting(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            seen[path] += 1
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return seen


async def put(store: FilesystemStore, key: str) -> None:
    staged = await store.stage(key, body(b"x" * 4096), size=4096)
    await store.publish(staged)


async def test_new_directories_are_fsynced_in_their_parents_once(tmp_path: Path, synced: Counter[str]) -> None:
    root = tmp_path / "blocks"
    store = FilesystemStore(root=root, fsync=True)
    await store.start()
    try:
        await put(store, KEY)
        made = [root / "ns_r0", root / "ns_r0/000", root / "ns_r0/000/10_g0"]
        for d in made:  # each directory made is durable in its parent: fsynced once there
            assert synced[str(d.parent)] == 1, (d, dict(synced))
        leaf = str(made[-1])
        assert synced[leaf] >= 1  # the rename's own directory fsync
        before = dict(synced)
        await put(store, OTHER)  # the same directories: nothing made, none of the parents fsynced again
        assert all(synced[str(d.parent)] == before[str(d.parent)] for d in made)
    finally:
        await store.close()


async def test_no_fsync_when_the_store_does_not_fsync(tmp_path: Path, synced: Counter[str]) -> None:
    store = FilesystemStore(root=tmp_path / "blocks", fsync=False)
    await store.start()
    try:
        await put(store, KEY)
        assert not synced
    finally:
        await store.close()
