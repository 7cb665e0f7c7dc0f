"""Write-time layout check: a namespace whose config records ``block_bytes`` refuses blocks of another size (422)."""

from __future__ import annotations

import httpx

from contract.keys import block_path, namespace_for
from tests.conftest import agnostic_fields

BLOCK_BYTES = 4096


def _namespace() -> tuple[str, dict[str, object]]:
    fields: dict[str, object] = {
        **agnostic_fields("layout/model", dtype="float16"),
        "canonical_format": "kvgate-v1-hnd",
        "block_bytes": BLOCK_BYTES,
    }
    return namespace_for(fields), fields


async def test_block_of_another_size_is_422_and_stores_nothing(client: httpx.AsyncClient) -> None:
    ns, fields = _namespace()
    key = block_path(namespace=ns, rank=0, block_hash=bytes(range(32)), group=0)
    before = await client.put(f"/v1/blocks/{key}", content=b"x" * 100)  # no config yet: no layout to check
    assert before.status_code == 201
    assert (await client.delete(f"/v1/blocks/{key}")).status_code == 204
    assert (await client.put(f"/v1/namespaces/{ns}/config", json=fields)).status_code == 201

    for size in (BLOCK_BYTES - 1, BLOCK_BYTES + 1, 0):
        r = await client.put(f"/v1/blocks/{key}", content=b"x" * size)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "layout_mismatch"
        assert str(BLOCK_BYTES) in r.json()["error"]["message"]
    part = await client.put(
        f"/v1/blocks/{key}", content=b"x" * 100, headers={"Content-Range": f"bytes 0-99/{BLOCK_BYTES * 2}"}
    )
    assert part.status_code == 422 and part.json()["error"]["code"] == "layout_mismatch"
    assert (await client.head(f"/v1/blocks/{key}")).status_code == 404
    assert (await client.post("/v1/lookup", json={"keys": [key]})).json()["prefix"] == 0

    ok = await client.put(f"/v1/blocks/{key}", content=b"y" * BLOCK_BYTES)
    assert ok.status_code == 201
    half = BLOCK_BYTES // 2
    key2 = block_path(namespace=ns, rank=0, block_hash=bytes(range(1, 33)), group=0)
    for a, b in ((0, half), (half, BLOCK_BYTES)):
        r = await client.put(
            f"/v1/blocks/{key2}", content=b"z" * (b - a), headers={"Content-Range": f"bytes {a}-{b - 1}/{BLOCK_BYTES}"}
        )
        assert r.status_code in (201, 202), r.text
    assert (await client.get(f"/v1/blocks/{key2}")).content == b"z" * BLOCK_BYTES
