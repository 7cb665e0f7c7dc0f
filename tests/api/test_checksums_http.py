"""Checksums on the wire, against real gateway processes: X-KVGate-Checksum verified as the body arrives (CRC64NVME
by default, sha256 on request), earlier clients' X-KVGate-SHA256, and rows written before revision 0005."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import httpx

from app.storage.checksums import checksum_of
from connector.http.client import BlockClient, ClientConfig
from contract.wire import (
    CHECKSUM_HEADER,
    DIGEST_HEADER,
    RANGE_CHECKSUM_HEADER,
    RANGE_DIGEST_HEADER,
    SHA256,
)
from tests.conftest import crc, crc_header, key_for, random_bytes, sha
from tests.gateway import REPO, Gateway

KiB = 1024


def leftovers(gw: Gateway) -> list[Path]:
    return [p for p in (gw.data_dir / "blocks").rglob("*") if p.is_file() and p.name != ".kvgate-owner"]


async def test_a_wrong_checksum_is_a_400_and_stores_nothing(client: httpx.AsyncClient, gateway: Gateway) -> None:
    """On main X-KVGate-Checksum was not read: a body that was not what its writer sent was stored (201)."""
    data, other = random_bytes(300 * KiB, 1), random_bytes(300 * KiB, 2)
    wrong = {
        "crc64nvme": checksum_of(other).header,
        "sha256": checksum_of(other, SHA256).header,
        "crc64nvme, one bit": "crc64nvme=" + base64.b64encode((checksum_of(data).crc ^ 1).to_bytes(8, "big")).decode(),
    }
    for i, (what, header) in enumerate(wrong.items()):
        key = key_for(10 + i)
        r = await client.put(f"/v1/blocks/{key}", content=data, headers={CHECKSUM_HEADER: header})
        assert r.status_code == 400 and r.json()["error"]["code"] == "digest_mismatch", (what, r.text)
        assert (await client.head(f"/v1/blocks/{key}")).status_code == 404, what
        assert (await client.post("/v1/lookup", json={"keys": [key]})).json()["prefix"] == 0
    for bad in ("crc64nvme=xyz", "md5=AAAAAAAAAAA=", "crc64nvme=AAAA", "sha256=" + "A" * 12):
        r = await client.put(f"/v1/blocks/{key_for(20)}", content=data, headers={CHECKSUM_HEADER: bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (bad, r.text)
    both = {CHECKSUM_HEADER: checksum_of(data).header, DIGEST_HEADER: sha(data)}  # two algorithms: which one?
    r = await client.put(f"/v1/blocks/{key_for(21)}", content=data, headers=both)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert leftovers(gateway) == []
    assert (await client.get("/v1/stats")).json()["blocks"] == 0
    # the right ones are stored, in the algorithm their writer chose
    ok = await client.put(f"/v1/blocks/{key_for(30)}", content=data, headers={CHECKSUM_HEADER: crc_header(data)})
    assert ok.status_code == 201 and ok.json()["digest"] == crc(data) and ok.headers["etag"] == f'"{crc(data)}"'
    signed = {CHECKSUM_HEADER: checksum_of(data, SHA256).header}
    ok = await client.put(f"/v1/blocks/{key_for(31)}", content=data, headers=signed)
    assert ok.status_code == 201 and ok.json()["digest"] == sha(data) and ok.headers["etag"] == f'"{sha(data)}"'
    got = await client.get(f"/v1/blocks/{key_for(31)}")
    assert got.content == data and got.headers[CHECKSUM_HEADER] == checksum_of(data, SHA256).header
    assert got.headers[DIGEST_HEADER] == sha(data)
    lookup = (await client.post("/v1/lookup", json={"keys": [key_for(30), key_for(31)]})).json()
    assert [b["etag"] for b in lookup["blocks"]] == [f'"{crc(data)}"', f'"{sha(data)}"']


async def test_a_stored_block_is_served_with_its_checksum(client: httpx.AsyncClient) -> None:
    """GET and HEAD answer the version's checksum (X-KVGate-Checksum, and the ETag quoting its token), whether the
    writer sent one or not; on main neither header named a CRC64NVME (the ETag was the sha256, no X-KVGate-Checksum)."""
    for i, send in enumerate((False, True)):
        key, data = key_for(60 + i), random_bytes(130 * KiB + i, 60 + i)
        sent = {CHECKSUM_HEADER: crc_header(data)} if send else {}
        put = await client.put(f"/v1/blocks/{key}", content=data, headers=sent)
        assert put.status_code == 201 and put.json()["digest"] == crc(data), put.text
        for r in (await client.get(f"/v1/blocks/{key}"), await client.head(f"/v1/blocks/{key}")):
            assert r.status_code == 200 and r.headers[CHECKSUM_HEADER] == crc_header(data)
            assert r.headers["etag"] == f'"{crc(data)}"' and DIGEST_HEADER not in r.headers
        assert (await client.get(f"/v1/blocks/{key}")).content == data


async def test_earlier_clients_that_send_x_kvgate_sha256(client: httpx.AsyncClient) -> None:
    """A client of an earlier release sends and checks hex sha256s: its writes are sha256 versions, answered with
    the headers it reads (ETag, X-KVGate-SHA256, and X-KVGate-Range-SHA256 on a range)."""
    key, data = key_for(40), random_bytes(200 * KiB + 3, 40)
    r = await client.put(f"/v1/blocks/{key}", content=data, headers={DIGEST_HEADER: sha(data)})
    assert r.status_code == 201 and r.json()["digest"] == sha(data) and r.headers["etag"] == f'"{sha(data)}"'
    again = await client.put(f"/v1/blocks/{key}", content=data, headers={DIGEST_HEADER: sha(data)})
    assert again.status_code == 200 and again.json()["created"] is False
    wrong = await client.put(f"/v1/blocks/{key}", content=data[:-1] + b"?", headers={DIGEST_HEADER: sha(data)})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "digest_mismatch"
    got = await client.get(f"/v1/blocks/{key}")
    assert got.content == data and got.headers["etag"] == f'"{sha(data)}"' and got.headers[DIGEST_HEADER] == sha(data)
    head = await client.head(f"/v1/blocks/{key}")
    assert head.headers[DIGEST_HEADER] == sha(data) and head.headers["etag"] == f'"{sha(data)}"'
    part = await client.get(f"/v1/blocks/{key}", headers={"Range": "bytes=70000-150000"})
    assert part.status_code == 206 and part.content == data[70000:150001]
    assert part.headers[RANGE_DIGEST_HEADER] == sha(data[70000:150001])
    assert part.headers[RANGE_CHECKSUM_HEADER] == crc_header(data[70000:150001])


def _rot(path: Path, at: int) -> None:
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x5A
    with path.open("r+b") as f:  # in place: inode and mtime stay (the version stamp cannot see it)
        f.write(raw)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_rows_written_before_the_migration_still_serve_and_verify(tmp_path: Path) -> None:
    """sha256 rows without chunk checksums (as every row before revision 0005): whole GETs, ranges (the gateway
    checks the whole object once, then streams) and the connector's loads, intact and rotten."""
    data_dir = tmp_path / "data"
    bodies = {key_for(50 + i): random_bytes(700 * KiB + i, 50 + i) for i in range(3)}
    gw = Gateway(data_dir).start()
    try:
        for key, data in bodies.items():
            r = httpx.put(f"{gw.url}/v1/blocks/{key}", content=data, headers={DIGEST_HEADER: sha(data)})
            assert r.status_code == 201
    finally:
        gw.stop()
    env = {**os.environ, "KVGATE_DATA_DIR": str(data_dir), "PYTHONPATH": str(REPO)}
    down = subprocess.run(
        [sys.executable, "-m", "alembic", "downgrade", "0004"], cwd=REPO, env=env, capture_output=True, timeout=120
    )
    assert down.returncode == 0, down.stderr.decode()
    gw = Gateway(data_dir).start()  # migrates to the head again: the rows keep no chunk checksums
    try:
        with BlockClient(ClientConfig(base_url=gw.url)) as bc:
            for key, data in bodies.items():
                got = httpx.get(f"{gw.url}/v1/blocks/{key}")
                assert got.content == data and got.headers["etag"] == f'"{sha(data)}"'
                part = httpx.get(f"{gw.url}/v1/blocks/{key}", headers={"Range": "bytes=1000-300000"})
                assert part.status_code == 206 and part.content == data[1000:300001]
                assert part.headers[RANGE_CHECKSUM_HEADER] == crc_header(data[1000:300001])
                assert part.headers[RANGE_DIGEST_HEADER] == sha(data[1000:300001])
                assert bc.run(bc.get(key, byte_range=(350 * KiB, 700 * KiB))) == data[350 * KiB : 700 * KiB]
                assert bc.run(bc.get(key)) == data
            rotten = key_for(51)
            _rot(data_dir / "blocks" / rotten, 600 * KiB)
            assert bc.run(bc.get(rotten, byte_range=(0, 100 * KiB))) is None  # the whole object is checked first
            assert bc.stats.corrupt_reads == 0  # the gateway found it and answered a miss
            assert bc.run(bc.get(rotten)) is None
            assert bc.stats.corrupt_reads == 1  # the client's sha256 check of the whole object
            overwrite = random_bytes(10 * KiB, 9)
            assert bc.run(bc.put(key_for(52), overwrite))  # a new version: CRC64NVME, with chunk checksums
            assert httpx.head(f"{gw.url}/v1/blocks/{key_for(52)}").headers["etag"] == f'"{crc(overwrite)}"'
    finally:
        gw.stop()
