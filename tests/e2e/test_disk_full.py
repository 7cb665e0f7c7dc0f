"""Disk full with the blocks AND the SQLite index on one small real tmpfs: a refused PUT leaves nothing behind.

Every PUT is answered 201/200 (then it must survive a restart byte for byte), or 507/503 (then nothing of it may
be served, now or after the restart's reconcile, unless a later PUT of the same key was acknowledged).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import crc, key_for, random_bytes
from tests.e2e.races import assert_fs_agrees
from tests.gateway import Gateway
from tests.services import require_or_skip


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        require_or_skip(f"cannot mount a tmpfs here (root needed): {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_with_index_on_the_same_filesystem(small_tmpfs: Path) -> None:
    gw = Gateway(small_tmpfs / "data", env={"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "true"}).start()
    acked: dict[str, str] = {}
    refused: dict[str, set[str]] = {}
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for i in range(60):  # 200-300 KiB blocks (and overwrites) into 6 MiB that also holds the index
                key = key_for(i % 40)
                data = random_bytes(200_000 + 2000 * i, i)
                r = c.put(f"/v1/blocks/{key}", content=data)
                if r.status_code in (200, 201):
                    acked[key] = crc(data)
                    refused.pop(key, None)
                else:
                    assert r.status_code in (503, 507), r.text
                    assert r.json()["error"]["code"] in ("insufficient_storage", "index_unavailable")
                    refused.setdefault(key, set()).add(crc(data))
            assert refused, "the filesystem never filled up"
            for key, digests in refused.items():
                got = c.get(f"/v1/blocks/{key}")
                assert got.status_code == 404 or crc(got.content) not in digests
    finally:
        gw.stop()
    gw.start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for key, digest in acked.items():
                got = c.get(f"/v1/blocks/{key}")
                assert got.status_code == 200 and crc(got.content) == digest, key
            for key in refused:
                if key not in acked:
                    assert c.head(f"/v1/blocks/{key}").status_code == 404, f"a refused PUT of {key} was adopted"
        rows = assert_fs_agrees(gw.data_dir)
        assert {k: d for k, (_, d) in rows.items()} == acked
        assert not list((small_tmpfs / "data").rglob(".kvgate-tmp-*"))
    finally:
        gw.stop()


def test_put_refused_by_the_index_is_never_adopted(tmp_path: Path) -> None:
    """The index cannot be written (another process holds its write lock): 503, and after a restart still nothing."""
    import sqlite3

    gw = Gateway(tmp_path / "data", env={"KVGATE_SQLITE_BUSY_TIMEOUT_S": "0.5"}).start()
    new, old_key = key_for(900), key_for(901)
    old, other = random_bytes(50_000, 1), random_bytes(60_000, 2)
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.put(f"/v1/blocks/{old_key}", content=old).status_code == 201
            holder = sqlite3.connect(gw.data_dir / "index.db", isolation_level=None, timeout=5)
            holder.execute("BEGIN EXCLUSIVE")
            try:
                r = c.put(f"/v1/blocks/{new}", content=other)
                assert r.status_code == 503 and r.json()["error"]["code"] == "index_unavailable"
                r = c.put(f"/v1/blocks/{old_key}", content=other)  # an overwrite refused the same way
                assert r.status_code == 503
            finally:
                holder.execute("ROLLBACK")
                holder.close()
            got = c.get(f"/v1/blocks/{old_key}")
            assert got.status_code == 200 and got.content == old  # the acknowledged version, not lost to a failure
    finally:
        gw.stop()
    gw.start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.head(f"/v1/blocks/{new}").status_code == 404, "a PUT answered 503 was adopted at restart"
            got = c.get(f"/v1/blocks/{old_key}")
            assert got.status_code == 200 and got.content == old
        assert_fs_agrees(gw.data_dir)
    finally:
        gw.stop()
