"""Faults: kill -9 under load, a client gone mid-upload, a full disk, a locked index."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for, matches, random_bytes, sha
from tests.security.conftest import bearer, start_secure
from tests.security.test_limits import put_head, temp_files, wait_until
from tests.services import require_or_skip

W = bearer("write")
A = bearer("admin")


def test_kill9_under_mixed_load_loses_nothing_acknowledged(tmp_path: Path) -> None:
    gw = start_secure(tmp_path / "data")
    acked: dict[str, str] = {}
    stop = threading.Event()

    async def client(n: int) -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10, headers=W) as c:
            i = n
            while not stop.is_set():
                data = random_bytes(64 * 1024, i)
                try:
                    r = await c.put(f"/v1/blocks/{key_for(i)}", content=data)
                    if r.status_code in (200, 201):
                        acked[key_for(i)] = sha(data)
                    await c.post("/v1/lookup", json={"keys": [key_for(i)]})
                    await c.get(f"/v1/blocks/{key_for(i)}")
                except httpx.HTTPError:
                    return
                i += 16

    async def load() -> None:
        await asyncio.wait_for(asyncio.gather(*(client(n) for n in range(16))), 60)

    t = threading.Thread(target=lambda: asyncio.run(load()))
    t.start()
    assert wait_until(lambda: len(acked) >= 100, timeout_s=40)
    gw.kill9()
    stop.set()
    t.join(60)
    gw.start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30, headers=W) as c:
            for key, digest in acked.items():
                r = c.get(f"/v1/blocks/{key}")
                assert r.status_code == 200, key
                assert sha(r.content) == digest and matches(r.headers["etag"], r.content)
    finally:
        gw.stop()


def test_client_gone_mid_upload_leaves_nothing(tmp_path: Path) -> None:
    import socket

    gw = start_secure(tmp_path / "data")
    try:
        for n in range(5):
            key = key_for(500 + n)
            with socket.create_connection(("127.0.0.1", gw.port)) as s:
                head = put_head(key, 4_000_000).replace(
                    b"\r\n\r\n", f"\r\nAuthorization: {W['Authorization']}\r\n\r\n".encode(), 1
                )
                s.sendall(head + b"q" * 1_000_000)
                time.sleep(0.2)
            assert wait_until(lambda: not temp_files(gw)), temp_files(gw)
            assert httpx.head(f"{gw.url}/v1/blocks/{key}", headers=W).status_code == 404
            lookup = httpx.post(f"{gw.url}/v1/lookup", json={"keys": [key]}, headers=W).json()
            assert lookup["prefix"] == 0
        assert not list((gw.data_dir / "blocks").rglob("*.bin"))
        assert httpx.get(f"{gw.url}/readyz").status_code == 200
    finally:
        gw.stop()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        require_or_skip(f"cannot mount a tmpfs here (root needed): {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_is_507_and_leaves_nothing(tmp_path: Path, small_fs: Path) -> None:
    gw = start_secure(tmp_path / "data", KVGATE_BACKEND__KIND="fs", KVGATE_BACKEND__ROOT=str(small_fs))
    try:
        stored: dict[str, bytes] = {}
        full_key = None
        with httpx.Client(base_url=gw.url, timeout=30, headers=W) as c:
            for i in range(10):  # 1 MiB blocks into a 4 MiB filesystem
                data = random_bytes(1024 * 1024, i)
                r = c.put(f"/v1/blocks/{key_for(i)}", content=data)
                if r.status_code == 507:
                    full_key = key_for(i)
                    assert r.json()["error"]["code"] == "insufficient_storage"
                    break
                assert r.status_code == 201, r.text
                stored[key_for(i)] = data
            assert full_key is not None and len(stored) >= 2
            assert not list(small_fs.rglob(".kvgate-tmp-*"))
            assert c.head(f"/v1/blocks/{full_key}").status_code == 404
            with sqlite3.connect(gw.data_dir / "index.db") as db:
                assert db.execute("select count(*) from blocks where key = ?", (full_key,)).fetchone()[0] == 0
            for key, data in stored.items():  # still serving what it has
                assert c.get(f"/v1/blocks/{key}").content == data
            victim = next(iter(stored))
            assert c.delete(f"/v1/blocks/{victim}", headers=A).status_code == 204
            data = random_bytes(1024 * 1024, 99)
            assert c.put(f"/v1/blocks/{full_key}", content=data).status_code == 201  # room again
            assert c.get(f"/v1/blocks/{full_key}").content == data
    finally:
        gw.stop()


def test_locked_index_is_503_then_recovers(tmp_path: Path) -> None:
    gw = start_secure(tmp_path / "data", KVGATE_SQLITE_BUSY_TIMEOUT_S="0.5")
    try:
        with httpx.Client(base_url=gw.url, timeout=30, headers=W) as c:
            present = random_bytes(10_000, 1)
            assert c.put(f"/v1/blocks/{key_for(1)}", content=present).status_code == 201
            holder = sqlite3.connect(gw.data_dir / "index.db", isolation_level=None, timeout=5)
            holder.execute("BEGIN EXCLUSIVE")
            try:
                r = c.put(f"/v1/blocks/{key_for(2)}", content=b"new" * 1000)
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "index_unavailable"
                ready = httpx.get(f"{gw.url}/readyz")
                assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
                # WAL: reads go on under a write lock, so a present block is still served, an absent one a miss
                assert c.get(f"/v1/blocks/{key_for(1)}").content == present
                assert c.head(f"/v1/blocks/{key_for(2)}").status_code == 404
                # Overwriting a present block while its row cannot be updated: never new bytes under the old ETag.
                r = c.put(f"/v1/blocks/{key_for(1)}", content=b"other" * 2000)
                assert r.status_code == 503
                got = c.get(f"/v1/blocks/{key_for(1)}")
                assert got.status_code == 404 or (got.content == present and matches(got.headers["etag"], present))
            finally:
                holder.execute("ROLLBACK")
                holder.close()
            assert c.put(f"/v1/blocks/{key_for(2)}", content=b"new" * 1000).status_code in (200, 201)
            assert c.get(f"/v1/blocks/{key_for(2)}").content == b"new" * 1000
            assert httpx.get(f"{gw.url}/readyz").status_code == 200
    finally:
        gw.stop()
