"""Multi-part objects through a real gateway: PUT with Content-Range, visible only once the parts cover it."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.core.parts import PARTS_PREFIX
from contract.keys import InvalidKey, parse_block_key
from contract.wire import PART_DIGEST_HEADER
from tests.conftest import key_for, random_bytes, sha
from tests.gateway import REPO, Gateway


def part_headers(start: int, end: int, total: int, data: bytes) -> dict[str, str]:
    return {"Content-Range": f"bytes {start}-{end - 1}/{total}", PART_DIGEST_HEADER: sha(data)}


async def put_part(c: httpx.AsyncClient, key: str, blob: bytes, start: int, end: int) -> httpx.Response:
    data = blob[start:end]
    return await c.put(f"/v1/blocks/{key}", content=data, headers=part_headers(start, end, len(blob), data))


async def test_object_visible_only_when_parts_cover_it(client: httpx.AsyncClient) -> None:
    key, blob = key_for(1), random_bytes(4 * 1000, seed=1)
    bounds = [(0, 1000), (1000, 2000), (2000, 3000), (3000, 4000)]
    for i, (start, end) in enumerate([bounds[2], bounds[0], bounds[3]]):
        r = await put_part(client, key, blob, start, end)
        assert r.status_code == 202, r.text
        assert r.json()["complete"] is False
        assert (await client.head(f"/v1/blocks/{key}")).status_code == 404, i
        assert (await client.get(f"/v1/blocks/{key}")).status_code == 404
        lk = (await client.post("/v1/lookup", json={"keys": [key]})).json()
        assert lk["prefix"] == 0 and lk["blocks"][0]["present"] is False
    r = await put_part(client, key, blob, *bounds[1])
    assert r.status_code == 201, r.text
    assert r.json()["complete"] is True and r.json()["digest"] == sha(blob)
    got = await client.get(f"/v1/blocks/{key}")
    assert got.status_code == 200 and got.content == blob
    assert got.headers["etag"] == f'"{sha(blob)}"'
    ranged = await client.get(f"/v1/blocks/{key}", headers={"Range": "bytes=1000-2999"})
    assert ranged.status_code == 206 and ranged.content == blob[1000:3000]
    lk = (await client.post("/v1/lookup", json={"keys": [key]})).json()
    assert lk["prefix"] == 1 and lk["blocks"][0]["size"] == len(blob)
    # a part re-sent after completion changes nothing
    again = await put_part(client, key, blob, *bounds[0])
    assert again.status_code == 200 and again.json()["complete"] is True


async def test_parts_are_cleaned_up_after_assembly(client: httpx.AsyncClient, gateway: Gateway) -> None:
    key, blob = key_for(2), random_bytes(3000, seed=2)
    for start, end in [(0, 1500), (1500, 3000)]:
        assert (await put_part(client, key, blob, start, end)).status_code in (201, 202)
    parts_dir = gateway.data_dir / "blocks" / PARTS_PREFIX.rstrip("/")
    leftover = [p for p in parts_dir.rglob("*") if p.is_file()] if parts_dir.exists() else []
    assert leftover == []
    final = gateway.data_dir / "blocks" / key
    assert final.read_bytes() == blob


async def test_concurrent_final_parts_assemble_once_and_lose_nothing(client: httpx.AsyncClient) -> None:
    blobs = {key_for(100 + i): random_bytes(8 * 4096, seed=100 + i) for i in range(6)}
    jobs = [
        put_part(client, key, blob, start, start + 4096)
        for key, blob in blobs.items()
        for start in range(0, 8 * 4096, 4096)
    ]
    results = await asyncio.gather(*jobs)
    assert all(r.status_code in (201, 202) for r in results), [r.text for r in results if r.status_code >= 300]
    assert sum(r.status_code == 201 for r in results) == len(blobs)  # exactly one PUT completes each object
    for key, blob in blobs.items():
        got = await client.get(f"/v1/blocks/{key}")
        assert got.status_code == 200 and got.content == blob


async def test_same_part_twice_is_idempotent(client: httpx.AsyncClient) -> None:
    key, blob = key_for(3), random_bytes(2000, seed=3)
    assert (await put_part(client, key, blob, 0, 1000)).status_code == 202
    r = await put_part(client, key, blob, 0, 1000)
    assert r.status_code == 200 and r.json()["complete"] is False
    assert (await put_part(client, key, blob, 1000, 2000)).status_code == 201
    assert (await client.get(f"/v1/blocks/{key}")).content == blob


@pytest.mark.parametrize(
    ("first", "second", "status"),
    [
        ((0, 1000, 2000), (500, 1500, 2000), 409),  # overlap
        ((0, 1000, 2000), (1000, 3000, 3000), 409),  # another total
        ((0, 1000, 2000), (0, 1000, 2000), 409),  # same range, other bytes
    ],
)
async def test_inconsistent_parts_conflict(
    client: httpx.AsyncClient, first: tuple[int, int, int], second: tuple[int, int, int], status: int
) -> None:
    key = key_for(4)
    a = random_bytes(first[1] - first[0], seed=4)
    r = await client.put(f"/v1/blocks/{key}", content=a, headers=part_headers(first[0], first[1], first[2], a))
    assert r.status_code == 202
    b = random_bytes(second[1] - second[0], seed=5)
    r = await client.put(f"/v1/blocks/{key}", content=b, headers=part_headers(second[0], second[1], second[2], b))
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == "conflict"
    assert (await client.head(f"/v1/blocks/{key}")).status_code == 404


async def test_bad_ranges_and_digests(client: httpx.AsyncClient) -> None:
    key, data = key_for(5), b"x" * 100
    url = f"/v1/blocks/{key}"
    r = await client.put(url, content=data, headers={"Content-Range": "bytes 0-99/50"})
    assert r.status_code == 416 and r.headers["content-range"] == "bytes */50"
    r = await client.put(url, content=data, headers={"Content-Range": "bytes 0-49/200"})
    assert r.status_code == 400  # Content-Length disagrees with the range
    r = await client.put(url, content=data, headers={"Content-Range": "bytes=0-99/200"})
    assert r.status_code == 400
    r = await client.put(url, content=data, headers={"Content-Range": "bytes 0-99/200", PART_DIGEST_HEADER: "0" * 64})
    assert r.status_code == 400 and r.json()["error"]["code"] == "digest_mismatch"
    r = await client.put(url, content=data, headers={"Content-Range": "bytes 0-99/200", PART_DIGEST_HEADER: "zz"})
    assert r.status_code == 400
    assert (await client.head(url)).status_code == 404


async def test_part_of_complete_object_with_other_total_conflicts(client: httpx.AsyncClient) -> None:
    key, blob = key_for(6), random_bytes(1000, seed=6)
    assert (await client.put(f"/v1/blocks/{key}", content=blob)).status_code == 201
    r = await client.put(f"/v1/blocks/{key}", content=blob[:500], headers=part_headers(0, 500, 2000, blob[:500]))
    assert r.status_code == 409


async def test_parts_survive_a_restart(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data").start()
    key, blob = key_for(7), random_bytes(2000, seed=7)
    try:
        async with httpx.AsyncClient(base_url=gw.url) as c:
            assert (await put_part(c, key, blob, 0, 1000)).status_code == 202
        gw.kill9()
        gw.start()
        async with httpx.AsyncClient(base_url=gw.url) as c:
            assert (await put_part(c, key, blob, 1000, 2000)).status_code == 201
            assert (await c.get(f"/v1/blocks/{key}")).content == blob
    finally:
        gw.stop()


def test_part_store_keys_are_never_block_keys() -> None:
    key = key_for(8)
    for candidate in (f"{PARTS_PREFIX}{key}/0-99.abc", f"{PARTS_PREFIX}{key}", PARTS_PREFIX + "x"):
        with pytest.raises(InvalidKey):
            parse_block_key(candidate)
    assert not os.path.isabs(PARTS_PREFIX)


async def test_part_key_rejected_as_client_key(client: httpx.AsyncClient) -> None:
    r = await client.put(f"/v1/blocks/{PARTS_PREFIX}{key_for(9)}/0-9.x", content=b"0123456789")
    assert r.status_code == 400


def _part_files(gw: Gateway) -> list[Path]:
    root = gw.data_dir / "blocks" / PARTS_PREFIX.rstrip("/")
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def _part_rows(gw: Gateway) -> int:
    with sqlite3.connect(gw.data_dir / "index.db") as db:
        return int(db.execute("select count(*) from parts").fetchone()[0])


async def test_purge_and_gc_drop_incomplete_uploads(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data").start()
    try:
        async with httpx.AsyncClient(base_url=gw.url) as c:
            for i, key in enumerate([key_for(40), key_for(41)]):
                blob = random_bytes(2000, seed=40 + i)
                assert (await put_part(c, key, blob, 0, 1000)).status_code == 202
            assert len(_part_files(gw)) == 2 and _part_rows(gw) == 2
            ns = key_for(40).split("_r0/")[0]
            purge = await c.delete(f"/v1/namespaces/{ns}")
            assert purge.status_code == 200, purge.text
            assert _part_files(gw) == [] and _part_rows(gw) == 0
            # an upload left half done by a writer that died: gc drops it once it is older than the bound
            blob = random_bytes(2000, seed=42)
            assert (await put_part(c, key_for(42), blob, 0, 1000)).status_code == 202
        gw.stop()
        # the empty directory an upload of an earlier version left behind (one per object), an old and a young one
        parts_root = gw.data_dir / "blocks" / PARTS_PREFIX.rstrip("/")
        old_dir, young_dir = parts_root / key_for(43), parts_root / key_for(44)
        for d in (old_dir, young_dir):
            d.mkdir(parents=True)
        os.utime(old_dir, (time.time() - 7200, time.time() - 7200))
        env = {**os.environ, "PYTHONPATH": str(REPO), "KVGATE_DATA_DIR": str(gw.data_dir)}
        keep = subprocess.run(
            [sys.executable, "-m", "app", "gc"], cwd=REPO, env=env, capture_output=True, timeout=120, check=True
        )
        assert len(_part_files(gw)) == 1 and _part_rows(gw) == 1, keep.stdout.decode()  # young: kept
        assert not old_dir.exists() and old_dir.parent.is_dir() and young_dir.is_dir()
        assert "empty upload directories removed" in keep.stdout.decode()
        subprocess.run(
            [sys.executable, "-m", "app", "gc", "--stale-parts-s", "0"],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=120,
            check=True,
        )
        assert _part_files(gw) == [] and _part_rows(gw) == 0
        assert not young_dir.exists()
        gw.start()
        async with httpx.AsyncClient(base_url=gw.url) as c:
            assert (await c.head(f"/v1/blocks/{key_for(42)}")).status_code == 404
            assert (await put_part(c, key_for(42), blob, 1000, 2000)).status_code == 202  # starts afresh
    finally:
        gw.stop()
