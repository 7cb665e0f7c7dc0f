"""Multi-part objects in process: PUT with Content-Range, visible only once the parts cover the object."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from app.core.parts import PARTS_PREFIX
from contract.wire import PART_DIGEST_HEADER
from tests.conftest import key_for, random_bytes, sha
from tests.inprocess.harness import InProcessGateway, running, settings_for


def part_headers(start: int, end: int, total: int, data: bytes) -> dict[str, str]:
    return {"Content-Range": f"bytes {start}-{end - 1}/{total}", PART_DIGEST_HEADER: sha(data)}


async def put_part(c: httpx.AsyncClient, key: str, blob: bytes, start: int, end: int) -> httpx.Response:
    data = blob[start:end]
    return await c.put(f"/v1/blocks/{key}", content=data, headers=part_headers(start, end, len(blob), data))


def part_files(root: Path) -> list[Path]:
    parts = root / "blocks" / PARTS_PREFIX.rstrip("/")
    return [p for p in parts.rglob("*") if p.is_file()] if parts.exists() else []


async def test_object_visible_only_when_parts_cover_it(gw: InProcessGateway) -> None:
    c = gw.client
    key, blob = key_for(1), random_bytes(4000, seed=1)
    bounds = [(0, 1000), (1000, 2000), (2000, 3000), (3000, 4000)]
    for i, (start, end) in enumerate([bounds[2], bounds[0], bounds[3]]):
        r = await put_part(c, key, blob, start, end)
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["complete"] is False and body["digest"] is None
        assert (body["start"], body["end"], body["total"]) == (start, end - 1, 4000)
        assert body["part_digest"] == sha(blob[start:end])
        assert "etag" not in r.headers
        assert (await c.head(f"/v1/blocks/{key}")).status_code == 404, i
        assert (await c.get(f"/v1/blocks/{key}")).status_code == 404
        lk = (await c.post("/v1/lookup", json={"keys": [key]})).json()
        assert lk["prefix"] == 0 and lk["blocks"][0]["present"] is False
    stats = await gw.stats()
    assert stats["blocks"] == 0 and stats["usage_bytes"] == 3000  # stored parts count against capacity

    r = await put_part(c, key, blob, *bounds[1])
    assert r.status_code == 201, r.text
    assert r.json()["complete"] is True and r.json()["digest"] == sha(blob)
    assert r.headers["etag"] == f'"{sha(blob)}"'
    got = await c.get(f"/v1/blocks/{key}")
    assert got.status_code == 200 and got.content == blob
    assert got.headers["etag"] == f'"{sha(blob)}"'
    ranged = await c.get(f"/v1/blocks/{key}", headers={"Range": "bytes=1000-2999"})
    assert ranged.status_code == 206 and ranged.content == blob[1000:3000]
    stats = await gw.stats()
    assert stats["blocks"] == 1 and stats["usage_bytes"] == 4000  # the parts' bytes became the block's

    again = await put_part(c, key, blob, *bounds[0])  # a part re-sent after completion changes nothing
    assert again.status_code == 200 and again.json()["complete"] is True
    assert again.json()["digest"] == sha(blob)
    late = await put_part(c, key, random_bytes(4000, seed=9), *bounds[0])  # ...even with other bytes
    assert late.status_code == 200
    assert (await c.get(f"/v1/blocks/{key}")).content == blob


async def test_parts_are_dropped_after_assembly(fs_gw: InProcessGateway, tmp_path: Path) -> None:
    key, blob = key_for(2), random_bytes(3000, seed=2)
    assert (await put_part(fs_gw.client, key, blob, 0, 1500)).status_code == 202
    assert len(part_files(tmp_path)) == 1
    assert (await put_part(fs_gw.client, key, blob, 1500, 3000)).status_code == 201
    assert part_files(tmp_path) == []
    assert (tmp_path / "blocks" / key).read_bytes() == blob


async def test_concurrent_final_parts_assemble_once(gw: InProcessGateway) -> None:
    blobs = {key_for(100 + i): random_bytes(8 * 512, seed=100 + i) for i in range(4)}
    jobs = [put_part(gw.client, k, b, s, s + 512) for k, b in blobs.items() for s in range(0, 8 * 512, 512)]
    results = await asyncio.gather(*jobs)
    assert all(r.status_code in (201, 202) for r in results), [r.text for r in results if r.status_code >= 300]
    assert sum(r.status_code == 201 for r in results) == len(blobs)  # exactly one PUT completes each object
    for key, blob in blobs.items():
        assert (await gw.client.get(f"/v1/blocks/{key}")).content == blob
    stats = await gw.stats()
    assert stats["blocks"] == 4 and stats["usage_bytes"] == 4 * 8 * 512


async def test_same_part_twice_is_idempotent(gw: InProcessGateway) -> None:
    key, blob = key_for(3), random_bytes(2000, seed=3)
    assert (await put_part(gw.client, key, blob, 0, 1000)).status_code == 202
    r = await put_part(gw.client, key, blob, 0, 1000)
    assert r.status_code == 200 and r.json()["complete"] is False
    assert (await gw.stats())["usage_bytes"] == 1000  # counted once
    assert (await put_part(gw.client, key, blob, 1000, 2000)).status_code == 201
    assert (await gw.client.get(f"/v1/blocks/{key}")).content == blob


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((0, 1000, 2000), (500, 1500, 2000)),  # overlap
        ((0, 1000, 2000), (1000, 3000, 3000)),  # another total
        ((0, 1000, 2000), (0, 1000, 2000)),  # same range, other bytes
    ],
    ids=["overlap", "other-total", "other-bytes"],
)
async def test_inconsistent_parts_conflict(
    gw: InProcessGateway, first: tuple[int, int, int], second: tuple[int, int, int]
) -> None:
    c, key = gw.client, key_for(4)
    a = random_bytes(first[1] - first[0], seed=4)
    assert (await c.put(f"/v1/blocks/{key}", content=a, headers=part_headers(*first, a))).status_code == 202
    b = random_bytes(second[1] - second[0], seed=5)
    r = await c.put(f"/v1/blocks/{key}", content=b, headers=part_headers(*second, b))
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "conflict"
    assert (await c.head(f"/v1/blocks/{key}")).status_code == 404
    assert (await gw.stats())["usage_bytes"] == first[1] - first[0]  # the refused part holds nothing


async def test_bad_ranges_and_digests(gw: InProcessGateway) -> None:
    c, key, data = gw.client, key_for(5), b"x" * 100
    url = f"/v1/blocks/{key}"
    r = await c.put(url, content=data, headers={"Content-Range": "bytes 0-99/50"})
    assert r.status_code == 416 and r.headers["content-range"] == "bytes */50"
    r = await c.put(url, content=data, headers={"Content-Range": "bytes 0-49/200"})
    assert r.status_code == 400  # Content-Length disagrees with the range
    for bad in ("bytes=0-99/200", "bytes 99-0/200", "bytes 0-99/*", "bytes -1-99/200"):
        r = await c.put(url, content=data, headers={"Content-Range": bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", bad
    r = await c.put(url, content=data, headers={"Content-Range": "bytes 0-99/200", PART_DIGEST_HEADER: "0" * 64})
    assert r.status_code == 400 and r.json()["error"]["code"] == "digest_mismatch"
    r = await c.put(url, content=data, headers={"Content-Range": "bytes 0-99/200", PART_DIGEST_HEADER: "zz"})
    assert r.status_code == 400
    assert (await c.head(url)).status_code == 404
    assert (await gw.stats())["usage_bytes"] == 0


async def test_part_of_complete_object_with_other_total_conflicts(gw: InProcessGateway) -> None:
    key, blob = key_for(6), random_bytes(1000, seed=6)
    assert (await gw.client.put(f"/v1/blocks/{key}", content=blob)).status_code == 201
    r = await gw.client.put(f"/v1/blocks/{key}", content=blob[:500], headers=part_headers(0, 500, 2000, blob[:500]))
    assert r.status_code == 409
    r = await put_part(gw.client, key, blob, 0, 500)  # same total, same bytes: nothing new
    assert r.status_code == 200 and r.json()["complete"] is True
    wrong = await gw.client.put(
        f"/v1/blocks/{key}",
        content=blob[:500],
        headers={"Content-Range": "bytes 0-499/1000", PART_DIGEST_HEADER: "0" * 64},
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "digest_mismatch"


async def test_create_only_parts(gw: InProcessGateway) -> None:
    key, blob = key_for(7), random_bytes(2000, seed=7)
    headers = {**part_headers(0, 1000, 2000, blob[:1000]), "If-None-Match": "*"}
    assert (await gw.client.put(f"/v1/blocks/{key}", content=blob[:1000], headers=headers)).status_code == 202
    headers = {**part_headers(1000, 2000, 2000, blob[1000:]), "If-None-Match": "*"}
    assert (await gw.client.put(f"/v1/blocks/{key}", content=blob[1000:], headers=headers)).status_code == 201
    r = await gw.client.put(f"/v1/blocks/{key}", content=blob[1000:], headers=headers)
    assert r.status_code == 412 and r.json()["error"]["code"] == "precondition_failed"


async def test_corrupt_stored_part_is_dropped_with_409(fs_gw: InProcessGateway, tmp_path: Path) -> None:
    key, blob = key_for(8), random_bytes(2000, seed=8)
    assert (await put_part(fs_gw.client, key, blob, 0, 1000)).status_code == 202
    (stored,) = part_files(tmp_path)
    stored.write_bytes(b"\0" * 1000)  # bit rot while the upload is half done
    r = await put_part(fs_gw.client, key, blob, 1000, 2000)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    assert (await fs_gw.client.head(f"/v1/blocks/{key}")).status_code == 404
    assert part_files(tmp_path) == []
    assert (await fs_gw.stats())["usage_bytes"] == 0
    for start, end, status in ((0, 1000, 202), (1000, 2000, 201)):  # the writers send them again
        assert (await put_part(fs_gw.client, key, blob, start, end)).status_code == status
    assert (await fs_gw.client.get(f"/v1/blocks/{key}")).content == blob


async def test_part_total_over_the_block_limit(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, max_block_bytes=1500)) as g:
        data = b"p" * 1000
        r = await g.client.put(f"/v1/blocks/{key_for(9)}", content=data, headers=part_headers(0, 1000, 2000, data))
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert (await g.stats())["usage_bytes"] == 0


async def test_purge_drops_incomplete_uploads(fs_gw: InProcessGateway, tmp_path: Path) -> None:
    for i in (40, 41):
        assert (await put_part(fs_gw.client, key_for(i), random_bytes(2000, seed=i), 0, 1000)).status_code == 202
    assert len(part_files(tmp_path)) == 2 and (await fs_gw.stats())["usage_bytes"] == 2000
    ns = key_for(40).split("_r0/")[0]
    assert (await fs_gw.client.delete(f"/v1/namespaces/{ns}")).status_code == 200
    assert part_files(tmp_path) == []
    assert (await fs_gw.stats())["usage_bytes"] == 0


async def test_in_place_parts_become_the_object_without_a_copy(fs_gw: InProcessGateway, tmp_path: Path) -> None:
    """On the filesystem the parts are written into the object's own file: the block published is that file."""
    key, blob = key_for(50), random_bytes(4 * 4096, seed=50)
    for start in (8192, 0, 12288):
        assert (await put_part(fs_gw.client, key, blob, start, start + 4096)).status_code == 202
    (upload,) = part_files(tmp_path)  # one file holds every part, each at its own offset
    assert upload.name.startswith(f"{key.rsplit('/', 1)[1]}.upload.")
    assert upload.read_bytes()[8192:12288] == blob[8192:12288]
    inode = upload.stat().st_ino
    r = await put_part(fs_gw.client, key, blob, 4096, 8192)
    assert r.status_code == 201 and r.headers["etag"] == f'"{sha(blob)}"'
    final = tmp_path / "blocks" / key
    assert final.stat().st_ino == inode and final.stat().st_nlink == 1  # the same bytes on disk, not a copy
    assert part_files(tmp_path) == []
    parts_root = tmp_path / "blocks" / PARTS_PREFIX.rstrip("/")
    assert parts_root / key.rsplit("/", 1)[0] == upload.parent  # no directory of its own per object
    got = await fs_gw.client.get(f"/v1/blocks/{key}")
    assert got.content == blob and got.headers["etag"] == f'"{sha(blob)}"'
    assert (await fs_gw.stats())["usage_bytes"] == len(blob)


@pytest.mark.parametrize("first_in_place", [False, True], ids=["object-per-part-first", "upload-first"])
async def test_parts_kept_either_way_assemble_together(
    fs_gw: InProcessGateway, tmp_path: Path, first_in_place: bool
) -> None:
    """An upload begun by a gateway that kept one object per part (or finished by one) still assembles right."""
    key, blob = key_for(51), random_bytes(3 * 1000, seed=51)
    store = fs_gw.core.store
    assert store.uploads
    for i, start in enumerate((0, 2000, 1000)):
        store.uploads = (i == 0) == first_in_place  # type: ignore[misc]  # a gateway of the release before
        r = await put_part(fs_gw.client, key, blob, start, start + 1000)
        assert r.status_code == (201 if i == 2 else 202), r.text
    del store.uploads  # type: ignore[misc]  # the class's own again
    got = await fs_gw.client.get(f"/v1/blocks/{key}")
    assert got.status_code == 200 and got.content == blob and got.headers["etag"] == f'"{sha(blob)}"'
    assert part_files(tmp_path) == []


async def test_in_place_parts_on_a_filesystem_without_hard_links(
    fs_gw: InProcessGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the data root takes no hard links the upload is copied into place: same answers, nothing left over."""
    import errno

    import app.storage.filesystem as fs

    def no_link(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(fs.os, "link", no_link)
    key, blob = key_for(52), random_bytes(3 * 1000, seed=52)
    for i, start in enumerate((1000, 0, 2000)):
        assert (await put_part(fs_gw.client, key, blob, start, start + 1000)).status_code == (201 if i == 2 else 202)
    got = await fs_gw.client.get(f"/v1/blocks/{key}")
    assert got.status_code == 200 and got.content == blob and got.headers["etag"] == f'"{sha(blob)}"'
    assert part_files(tmp_path) == [] and (tmp_path / "blocks" / key).read_bytes() == blob


@pytest.mark.parametrize("backend", ["memory", "fs"])
async def test_an_object_has_at_most_max_parts_parts(tmp_path: Path, backend: str) -> None:
    """Past ``max_parts_per_object`` recorded parts a new part is a 409 and holds nothing; re-sending a recorded
    part is still answered as before, and the object completes from its parts within the bound."""
    async with running(settings_for(tmp_path, max_parts_per_object=4, fs=backend == "fs")) as g:
        key, blob = key_for(70), random_bytes(600, seed=70)
        for start in (0, 100, 200, 300):
            assert (await put_part(g.client, key, blob, start, start + 100)).status_code == 202
        r = await put_part(g.client, key, blob, 400, 500)
        assert r.status_code == 409 and "at most 4" in r.json()["error"]["message"], r.text
        assert (await g.stats())["usage_bytes"] == 400
        assert (await put_part(g.client, key, blob, 0, 100)).status_code == 200  # the same part again
        key2, blob2 = key_for(71), random_bytes(400, seed=71)
        for start, status in ((0, 202), (100, 202), (200, 202), (300, 201)):
            assert (await put_part(g.client, key2, blob2, start, start + 100)).status_code == status
        assert (await g.client.get(f"/v1/blocks/{key2}")).content == blob2


@pytest.mark.parametrize("backend", ["memory", "fs"])
async def test_a_part_is_checked_against_its_neighbours(tmp_path: Path, backend: str) -> None:
    """With parts recorded at [0,100), [200,300), [400,500) of 600 bytes, each candidate is refused (409) exactly
    when it overlaps a recorded part (the brute-force answer), and accepted otherwise."""
    recorded = [(0, 100), (200, 300), (400, 500)]
    candidates = [(150, 250), (250, 350), (50, 150), (450, 600), (100, 200), (300, 400), (500, 600), (199, 201)]
    for n, (a, b) in enumerate(candidates):
        async with running(settings_for(tmp_path / str(n), fs=backend == "fs")) as g:
            key, blob = key_for(80 + n), random_bytes(600, seed=80 + n)
            for start, end in recorded:
                assert (await put_part(g.client, key, blob, start, end)).status_code == 202
            overlaps = any(a < end and start < b for start, end in recorded)
            r = await put_part(g.client, key, blob, a, b)
            assert r.status_code == (409 if overlaps else 202), ((a, b), r.text)
