"""Block PUT/GET/HEAD/DELETE, create-only, digests and ranges, in process, over the memory and the filesystem store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from contract.wire import CHECKSUM_HEADER, DIGEST_HEADER, RANGE_CHECKSUM_HEADER, RANGE_DIGEST_HEADER
from tests.conftest import crc, crc_header, key_for, random_bytes, sha
from tests.inprocess.harness import InProcessGateway, running, settings_for

KiB = 1024


@pytest.fixture(params=["memory", "fs"])
async def any_gw(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[InProcessGateway]:
    async with running(settings_for(tmp_path, fs=request.param == "fs", io_chunk_bytes=16 * KiB)) as g:
        yield g


async def test_put_get_head_delete(any_gw: InProcessGateway) -> None:
    c = any_gw.client
    blocks = {key_for(i): random_bytes(100 * KiB + i, i) for i in range(3)}
    for key, data in blocks.items():
        r = await c.put(f"/v1/blocks/{key}", content=data)
        assert r.status_code == 201, r.text
        assert r.json() == {"key": key, "size": len(data), "digest": crc(data), "created": True}
        assert r.headers["etag"] == f'"{crc(data)}"'
        assert r.headers["location"] == f"/v1/blocks/{key}"
    for key, data in blocks.items():
        got = await c.get(f"/v1/blocks/{key}")
        assert got.status_code == 200
        assert got.content == data
        assert got.headers["etag"] == f'"{crc(data)}"'
        assert got.headers[CHECKSUM_HEADER] == crc_header(data)
        assert DIGEST_HEADER not in got.headers  # only a version stored with a sha256 has one
        assert got.headers["content-length"] == str(len(data))
        assert got.headers["accept-ranges"] == "bytes"
        head = await c.head(f"/v1/blocks/{key}")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(data))
        assert head.headers["etag"] == f'"{crc(data)}"'
        assert head.headers[CHECKSUM_HEADER] == crc_header(data)

    key = key_for(0)
    assert (await c.delete(f"/v1/blocks/{key}")).status_code == 204
    miss = await c.get(f"/v1/blocks/{key}")
    assert miss.status_code == 404 and miss.json()["error"]["code"] == "not_found"
    assert (await c.head(f"/v1/blocks/{key}")).status_code == 404
    assert (await c.delete(f"/v1/blocks/{key}")).status_code == 404
    for other in (key_for(1), key_for(2)):
        assert (await c.get(f"/v1/blocks/{other}")).content == blocks[other]
    stats = await any_gw.stats()
    assert stats["blocks"] == 2 and stats["usage_bytes"] == len(blocks[key_for(1)]) + len(blocks[key_for(2)])


async def test_create_only_and_overwrite(any_gw: InProcessGateway) -> None:
    c = any_gw.client
    key, data = key_for(100), random_bytes(30 * KiB, 100)
    assert (await c.put(f"/v1/blocks/{key}", content=data, headers={"If-None-Match": "*"})).status_code == 201
    again = await c.put(f"/v1/blocks/{key}", content=data, headers={"If-None-Match": "*"})
    assert again.status_code == 412 and again.json()["error"]["code"] == "precondition_failed"
    other = random_bytes(10 * KiB, 101)
    refused = await c.put(f"/v1/blocks/{key}", content=other, headers={"If-None-Match": "*"})
    assert refused.status_code == 412
    assert (await c.get(f"/v1/blocks/{key}")).content == data  # create-only never replaces
    bad = await c.put(f"/v1/blocks/{key}", content=data, headers={"If-None-Match": '"abc"'})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"

    same = await c.put(f"/v1/blocks/{key}", content=data, headers={DIGEST_HEADER: sha(data)})
    assert same.status_code == 200 and same.json()["created"] is False
    replaced = await c.put(f"/v1/blocks/{key}", content=other)
    assert replaced.status_code == 200 and replaced.json()["created"] is False  # a new version of a present key
    got = await c.get(f"/v1/blocks/{key}")
    assert got.content == other and got.headers["etag"] == f'"{crc(other)}"'
    stats = await any_gw.stats()
    assert stats["blocks"] == 1 and stats["usage_bytes"] == len(other)


async def test_digest_checks_publish_nothing(any_gw: InProcessGateway) -> None:
    c = any_gw.client
    key, data = key_for(200), random_bytes(20 * KiB, 200)
    assert (await c.put(f"/v1/blocks/{key}", content=data)).status_code == 201
    other = random_bytes(1000, 201)
    wrong = await c.put(f"/v1/blocks/{key}", content=other, headers={DIGEST_HEADER: sha(data)})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "digest_mismatch"
    assert (await c.get(f"/v1/blocks/{key}")).content == data  # the old bytes stay
    new = key_for(202)
    assert (await c.put(f"/v1/blocks/{new}", content=other, headers={DIGEST_HEADER: "0" * 64})).status_code == 400
    assert (await c.head(f"/v1/blocks/{new}")).status_code == 404
    malformed = await c.put(f"/v1/blocks/{new}", content=other, headers={DIGEST_HEADER: "xyz"})
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_request"
    ok = await c.put(f"/v1/blocks/{new}", content=other, headers={DIGEST_HEADER: sha(other).upper()})
    assert ok.status_code == 201
    stats = await any_gw.stats()
    assert stats["blocks"] == 2 and stats["usage_bytes"] == len(data) + len(other)


async def test_empty_block_and_bad_keys(any_gw: InProcessGateway) -> None:
    c = any_gw.client
    empty = key_for(300)
    assert (await c.put(f"/v1/blocks/{empty}", content=b"")).status_code == 201
    got = await c.get(f"/v1/blocks/{empty}")
    assert got.status_code == 200 and got.content == b"" and got.headers["etag"] == f'"{crc(b"")}"'
    for bad in ("garbage", "a/%2e%2e/%2e%2e/etc/passwd", f"{key_for(1)}x", f"_parts/{key_for(1)}/0-9.x"):
        r = await c.put(f"/v1/blocks/{bad}", content=b"0123456789")
        assert r.status_code == 400, (bad, r.status_code)
        assert r.json()["error"]["code"] == "invalid_request", (bad, r.text)


async def test_ranges(any_gw: InProcessGateway) -> None:
    c = any_gw.client
    key, data = key_for(400), random_bytes(64 * KiB, 400)
    assert (await c.put(f"/v1/blocks/{key}", content=data)).status_code == 201
    size = len(data)
    cases = [  # Range header -> the half-open span served
        ("bytes=1000-40959", 1000, 40960),
        ("bytes=-10", size - 10, size),
        (f"bytes={size - 5}-", size - 5, size),
        ("bytes=0-0", 0, 1),
        (f"bytes=100-{size + 1000}", 100, size),  # the end is clipped to the object
    ]
    for header, start, end in cases:
        want = data[start:end]
        part = await c.get(f"/v1/blocks/{key}", headers={"Range": header})
        assert part.status_code == 206, (header, part.text)
        assert part.content == want, header
        assert part.headers["content-range"] == f"bytes {start}-{end - 1}/{size}", header
        assert part.headers["content-length"] == str(len(want))
        assert part.headers[RANGE_CHECKSUM_HEADER] == crc_header(want), header
        assert RANGE_DIGEST_HEADER not in part.headers  # only a version stored with a sha256 has one
        assert part.headers["etag"] == f'"{crc(data)}"'

    for header in (f"bytes={size}-", "bytes=-0", "bytes=5-1"):
        bad = await c.get(f"/v1/blocks/{key}", headers={"Range": header})
        assert bad.status_code == 416, header
        assert bad.headers["content-range"] == f"bytes */{size}"
        assert bad.json()["error"]["code"] == "range_not_satisfiable"
    for header in ("items=0-1", "bytes=0-1,4-5", "bytes=a-b", "bytes=-"):
        bad = await c.get(f"/v1/blocks/{key}", headers={"Range": header})
        assert bad.status_code == 400, (header, bad.status_code)
        assert bad.json()["error"]["code"] == "invalid_request"
    miss = await c.get(f"/v1/blocks/{key_for(401)}", headers={"Range": "bytes=0-1"})
    assert miss.status_code == 404


@pytest.mark.parametrize("fs", [False, True])
async def test_every_range_of_a_chunked_object_is_vouched_for(tmp_path: Path, fs: bool) -> None:
    """Ranges across the chunk grid (64 KiB chunks of a 1 MiB object, read 5 KiB at a time): aligned, cut at either
    end, inside one chunk, the whole object; a sha256 version also answers the range's sha256 (earlier clients)."""
    async with running(settings_for(tmp_path, fs=fs, io_chunk_bytes=5 * KiB)) as g:
        key, data = key_for(500), random_bytes(1024 * KiB + 17, 500)
        assert (await g.client.put(f"/v1/blocks/{key}", content=data)).status_code == 201
        legacy, old = key_for(501), random_bytes(300 * KiB, 501)
        r = await g.client.put(f"/v1/blocks/{legacy}", content=old, headers={DIGEST_HEADER: sha(old)})
        assert r.status_code == 201 and r.json()["digest"] == sha(old)
        spans = [(0, 64 * KiB), (64 * KiB, 256 * KiB), (1000, 70 * KiB), (65 * KiB, 66 * KiB), (0, len(data))]
        spans += [(3, 129 * KiB + 5), (len(data) - 17, len(data)), (len(data) - 100, len(data) - 1)]
        for start, end in spans:
            part = await g.client.get(f"/v1/blocks/{key}", headers={"Range": f"bytes={start}-{end - 1}"})
            assert part.status_code == 206 and part.content == data[start:end], (start, end)
            assert part.headers[RANGE_CHECKSUM_HEADER] == crc_header(data[start:end]), (start, end)
            if end <= len(old):
                part = await g.client.get(f"/v1/blocks/{legacy}", headers={"Range": f"bytes={start}-{end - 1}"})
                assert part.status_code == 206 and part.content == old[start:end], (start, end)
                assert part.headers[RANGE_CHECKSUM_HEADER] == crc_header(old[start:end]), (start, end)
                assert part.headers[RANGE_DIGEST_HEADER] == sha(old[start:end]), (start, end)
                assert part.headers["etag"] == f'"{sha(old)}"' and part.headers[DIGEST_HEADER] == sha(old)


async def test_size_limit_and_length_required(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, max_block_bytes=1000)) as g:
        c = g.client
        r = await c.put(f"/v1/blocks/{key_for(1)}", content=b"x" * 1001)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert (await c.head(f"/v1/blocks/{key_for(1)}")).status_code == 404
        assert (await c.put(f"/v1/blocks/{key_for(1)}", content=b"x" * 1000)).status_code == 201

        async def chunked() -> AsyncIterator[bytes]:
            yield b"abc"

        r = await c.put(f"/v1/blocks/{key_for(2)}", content=chunked())
        assert r.status_code == 411 and r.json()["error"]["code"] == "length_required"
        assert (await c.head(f"/v1/blocks/{key_for(2)}")).status_code == 404


async def test_fs_store_leaves_no_temp_files(fs_gw: InProcessGateway, tmp_path: Path) -> None:
    c = fs_gw.client
    key, data = key_for(600), random_bytes(40 * KiB, 600)
    assert (await c.put(f"/v1/blocks/{key}", content=data)).status_code == 201
    assert (await c.put(f"/v1/blocks/{key}", content=data[:10], headers={DIGEST_HEADER: sha(data)})).status_code == 400
    assert (tmp_path / "blocks" / key).read_bytes() == data
    assert [p for p in tmp_path.rglob("*") if p.name.startswith(".kvgate-tmp-")] == []
