"""Write-time layout check: a namespace whose config records ``block_bytes`` refuses blocks of another size (422)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from app.core.memo import NAMESPACE_RETRY_S
from contract.keys import block_path, namespace_for
from tests.conftest import agnostic_fields
from tests.gateway import Gateway

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


def test_a_config_stored_in_another_process_is_checked_here(tmp_path: Path) -> None:
    """Two gateway processes on one data directory (workers, or a restart beside a running one): a process that saw a
    namespace's blocks before its config, and so no layout to check, checks the layout once another process stored
    the config. Before, it kept "no layout" for good and stored blocks of any size in that namespace (fail open)."""
    ns, fields = _namespace()
    keys = [block_path(namespace=ns, rank=0, block_hash=bytes([i]) * 32, group=0) for i in range(3)]
    a = Gateway(tmp_path / "data").start()
    b = Gateway(tmp_path / "data").start()
    try:
        assert httpx.put(f"{b.url}/v1/blocks/{keys[0]}", content=b"x" * 100, timeout=30).status_code == 201
        assert httpx.put(f"{a.url}/v1/namespaces/{ns}/config", json=fields, timeout=30).status_code == 201
        time.sleep(NAMESPACE_RETRY_S + 0.1)  # a namespace without a config is looked up again after this long
        r = httpx.put(f"{b.url}/v1/blocks/{keys[1]}", content=b"x" * 100, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["code"] == "layout_mismatch", r.text
        assert httpx.head(f"{b.url}/v1/blocks/{keys[1]}", timeout=30).status_code == 404
        ok = httpx.put(f"{b.url}/v1/blocks/{keys[2]}", content=b"y" * BLOCK_BYTES, timeout=30)
        assert ok.status_code == 201
    finally:
        a.stop()
        b.stop()
