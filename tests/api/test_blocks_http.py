"""Block PUT/GET/HEAD/Range/DELETE against a real uvicorn process, with httpx and with curl."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
from pathlib import Path

import httpx

from contract.wire import DIGEST_HEADER
from tests.conftest import crc, key_for, random_bytes, sha
from tests.gateway import Gateway

MiB = 1024 * 1024


async def test_put_get_head_range_delete(client: httpx.AsyncClient) -> None:
    blocks = {key_for(i): random_bytes(2 * MiB, i) for i in range(4)}
    results = await asyncio.gather(*(client.put(f"/v1/blocks/{k}", content=v) for k, v in blocks.items()))
    assert [r.status_code for r in results] == [201] * 4
    for (key, data), r in zip(blocks.items(), results, strict=True):
        assert r.json() == {"key": key, "size": len(data), "digest": crc(data), "created": True}
        assert r.headers["etag"] == f'"{crc(data)}"'

    for key, data in blocks.items():
        got = await client.get(f"/v1/blocks/{key}")
        assert got.status_code == 200
        assert sha(got.content) == sha(data)
        assert got.headers["etag"] == f'"{crc(data)}"'
        assert got.headers["content-length"] == str(2 * MiB)

        head = await client.head(f"/v1/blocks/{key}")
        assert head.status_code == 200
        assert head.content == b""
        assert head.headers["content-length"] == str(2 * MiB)
        assert head.headers["etag"] == f'"{crc(data)}"'

        part = await client.get(f"/v1/blocks/{key}", headers={"Range": "bytes=1000-1048575"})
        assert part.status_code == 206
        assert part.content == data[1000:1048576]
        assert part.headers["content-range"] == f"bytes 1000-1048575/{2 * MiB}"
        tail = await client.get(f"/v1/blocks/{key}", headers={"Range": "bytes=-10"})
        assert tail.status_code == 206 and tail.content == data[-10:]
        openended = await client.get(f"/v1/blocks/{key}", headers={"Range": f"bytes={2 * MiB - 5}-"})
        assert openended.content == data[-5:]

    key = next(iter(blocks))
    bad = await client.get(f"/v1/blocks/{key}", headers={"Range": f"bytes={2 * MiB}-"})
    assert bad.status_code == 416
    assert bad.headers["content-range"] == f"bytes */{2 * MiB}"
    assert bad.json()["error"]["code"] == "range_not_satisfiable"

    assert (await client.delete(f"/v1/blocks/{key}")).status_code == 204
    miss = await client.get(f"/v1/blocks/{key}")
    assert miss.status_code == 404 and miss.json()["error"]["code"] == "not_found"
    assert (await client.head(f"/v1/blocks/{key}")).status_code == 404
    assert (await client.delete(f"/v1/blocks/{key}")).status_code == 404
    # the others are untouched
    for other in list(blocks)[1:]:
        assert (await client.head(f"/v1/blocks/{other}")).status_code == 200


async def test_put_semantics(client: httpx.AsyncClient, gateway: Gateway) -> None:
    key = key_for(100)
    data = random_bytes(300_000, 100)
    assert (await client.put(f"/v1/blocks/{key}", content=data, headers={"If-None-Match": "*"})).status_code == 201
    again = await client.put(f"/v1/blocks/{key}", content=data, headers={"If-None-Match": "*"})
    assert again.status_code == 412 and again.json()["error"]["code"] == "precondition_failed"
    same = await client.put(f"/v1/blocks/{key}", content=data, headers={DIGEST_HEADER: sha(data)})
    assert same.status_code == 200 and same.json()["created"] is False
    plain = await client.put(f"/v1/blocks/{key}", content=data)
    assert plain.status_code == 200

    # a wrong digest publishes nothing: the old bytes stay, a new key stays absent
    other = random_bytes(1000, 101)
    wrong = await client.put(f"/v1/blocks/{key}", content=other, headers={DIGEST_HEADER: sha(data)})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "digest_mismatch"
    assert (await client.get(f"/v1/blocks/{key}")).content == data
    new = key_for(102)
    wrong = await client.put(f"/v1/blocks/{new}", content=other, headers={DIGEST_HEADER: "0" * 64})
    assert wrong.status_code == 400
    assert (await client.head(f"/v1/blocks/{new}")).status_code == 404
    ok = await client.put(f"/v1/blocks/{new}", content=other, headers={DIGEST_HEADER: sha(other).upper()})
    assert ok.status_code == 201
    # an empty block is a block
    empty = key_for(103)
    assert (await client.put(f"/v1/blocks/{empty}", content=b"")).status_code == 201
    got = await client.get(f"/v1/blocks/{empty}")
    assert got.status_code == 200 and got.content == b"" and got.headers["etag"] == f'"{crc(b"")}"'
    leftovers = [p for p in gateway.data_dir.rglob("*") if p.name.startswith(".kvgate-tmp-")]
    assert leftovers == []


def curl(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["curl", "-sS", *args], capture_output=True, timeout=60, check=False)


def test_operator_path_with_curl(gateway: Gateway, tmp_path: Path) -> None:
    key = key_for(7)
    data = random_bytes(2 * MiB, 7)
    src = tmp_path / "block.bin"
    src.write_bytes(data)
    url = f"{gateway.url}/v1/blocks/{key}"

    put = curl("-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT", "--data-binary", f"@{src}", url)
    assert put.stdout == b"201", put.stderr
    got = curl(url)
    assert hashlib.sha256(got.stdout).hexdigest() == sha(data)
    head = curl("-I", url)
    lines = head.stdout.decode().lower().splitlines()
    assert lines[0].startswith("http/1.1 200")
    assert f"content-length: {2 * MiB}" in lines
    assert f'etag: "{crc(data)}"' in lines
    rng = curl("-r", "0-99", url)
    assert rng.stdout == data[:100]
    miss = curl("-o", "/dev/null", "-w", "%{http_code}", f"{gateway.url}/v1/blocks/{key_for(8)}")
    assert miss.stdout == b"404"
    # curl sends a chunked body when told to: no Content-Length is a 411, nothing stored
    chunked = curl(
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-X",
        "PUT",
        "-H",
        "Transfer-Encoding: chunked",
        "--data-binary",
        f"@{src}",
        f"{gateway.url}/v1/blocks/{key_for(9)}",
    )
    assert chunked.stdout == b"411"
    assert curl("-o", "/dev/null", "-w", "%{http_code}", "-I", f"{gateway.url}/v1/blocks/{key_for(9)}").stdout == b"404"
    dele = curl("-o", "/dev/null", "-w", "%{http_code}", "-X", "DELETE", url)
    assert dele.stdout == b"204"
    assert curl("-o", "/dev/null", "-w", "%{http_code}", url).stdout == b"404"


async def test_namespace_config(client: httpx.AsyncClient) -> None:
    from contract.keys import namespace_for, run_fields

    fields = run_fields(
        model_name="org/m",
        tokens_per_hash=16,
        blocks_per_file=1,
        tp_size=2,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        dtype="float16",
    )
    ns = namespace_for(fields)
    r = await client.put(f"/v1/namespaces/{ns}/config", json=fields)
    assert r.status_code == 201
    assert (await client.put(f"/v1/namespaces/{ns}/config", json=fields)).status_code == 200
    got = await client.get(f"/v1/namespaces/{ns}/config")
    assert got.status_code == 200 and got.json() == fields
    mismatch = await client.put(f"/v1/namespaces/{ns}/config", json={**fields, "tp_size": 4})
    assert mismatch.status_code == 409 and mismatch.json()["error"]["code"] == "conflict"
    other = "org_m_000000000000"
    assert (await client.get(f"/v1/namespaces/{other}/config")).status_code == 404
    assert (await client.get("/v1/namespaces/..%2fetc/config")).status_code in (400, 404)


async def test_size_limit(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data", env={"KVGATE_MAX_BLOCK_BYTES": "1000"}).start()
    try:
        async with httpx.AsyncClient(base_url=gw.url) as c:
            r = await c.put(f"/v1/blocks/{key_for(1)}", content=b"x" * 1001)
            assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
            assert (await c.put(f"/v1/blocks/{key_for(1)}", content=b"x" * 1000)).status_code == 201
    finally:
        gw.stop()
