"""The filesystem store's key-to-file mapping refuses every key the strict reference refuses (defence in depth
behind contract.keys) and maps the others under the root."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import InvalidRequest
from app.storage.filesystem import FilesystemStore


def reference_ok(key: str) -> bool:
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or "\0" in key or any(p in ("", ".", "..") for p in parts):
        return False
    return not any(p.startswith(".") for p in parts)


KEYS = [
    "", "/", "a", "a/b.bin", "/a", "a/", "a//b", ".", "..", "a/..", "../a", "a/../b", "a/./b", "./a", ".a/b",
    "a/.b", "a/b/.kvgate-tmp-x", "a\\b", "a\0b", "_parts/ns_r0/000/10_g0/ab.bin.upload.1", "a/b..c", "a.b/c",
    "ns_r0/000/10_g0/" + "f" * 64 + ".bin", "a/b/", "a..", "..a", "a/..b",
]  # fmt: skip


@pytest.mark.parametrize("key", KEYS)
def test_file_of_refuses_what_the_reference_refuses(tmp_path: Path, key: str) -> None:
    store = FilesystemStore(root=tmp_path)
    if reference_ok(key):
        assert store.file_of(key) == str(tmp_path.resolve() / key)
        assert store.path_of(key) == tmp_path.resolve() / key
    else:
        with pytest.raises(InvalidRequest):
            store.file_of(key)
        with pytest.raises(InvalidRequest):
            store.path_of(key)
