"""Usage survives a restart; reconcile makes the index agree with what is really on disk."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx

from contract.keys import config_path, namespace_for
from tests.capacity.helpers import block_files, index_rows
from tests.conftest import agnostic_fields, key_for, matches
from tests.gateway import Gateway

N = 10_000
# Bodies are small and distinct: block i holds its own index, so sizes vary (1..N digits) and digests differ.
FAST = {"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "false", "KVGATE_SQLITE_SYNCHRONOUS": "NORMAL"}


def body(i: int) -> bytes:
    return f"kv-block-{i}".encode() * (1 + i % 7)


async def put_all(url: str, ids: range) -> None:
    sem = asyncio.Semaphore(16)
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:

        async def one(i: int) -> None:
            async with sem:
                r = await c.put(f"/v1/blocks/{key_for(i)}", content=body(i))
                assert r.status_code == 201, r.text

        await asyncio.gather(*(one(i) for i in ids))


def stats(c: httpx.Client) -> dict[str, Any]:
    s: dict[str, Any] = c.get("/v1/stats").json()
    return s


def write_block_files(root: Path, ids: range) -> None:
    """Block files exactly as the filesystem store (and vLLM's fs tier) lays them out, without index rows."""
    for i in ids:
        p = root / key_for(i)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body(i))


def test_restart_keeps_usage_and_reconcile_shows_changes_behind_its_back(tmp_path: Path) -> None:
    # 10,000 blocks: most are laid down as files before the first start (the start-up reconcile must adopt them
    # all: that is the 10k-scale path under test, and it keeps the test inside its time budget on 2 cores);
    # the last 500 go through PUT at concurrency 16 (data + rows written by the gateway itself).
    gw = Gateway(tmp_path / "data", env=FAST)
    write_block_files(gw.data_dir / "blocks", range(N - 500))
    gw.start()
    try:
        asyncio.run(put_all(gw.url, range(N - 500, N)))
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            g = c.get(f"/v1/blocks/{key_for(1)}")  # an adopted block: digest recomputed
            assert g.content == body(1) and matches(g.headers["etag"], body(1))
            before = stats(c)
            ns_before = c.get("/v1/namespaces").json()  # flushes the GET's access time first
            assert ns_before["namespaces"][0]["hits"] == 1
        expected_bytes = sum(len(body(i)) for i in range(N))
        assert (before["blocks"], before["usage_bytes"]) == (N, expected_bytes)
        assert index_rows(gw.data_dir) == block_files(gw.data_dir)

        gw.restart()
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            after = stats(c)
            assert (after["blocks"], after["usage_bytes"]) == (N, expected_bytes)
            ns_after = c.get("/v1/namespaces").json()
            assert ns_after == ns_before
        gw.stop()

        # Behind its back: 100 block files gone, 50 valid block files added, one config, junk, a torn temp file.
        root = gw.data_dir / "blocks"
        gone = list(range(0, 1000, 10))
        for i in gone:
            (root / key_for(i)).unlink()
        added = {N + j: os.urandom(100 + j) for j in range(50)}
        for i, data in added.items():
            p = root / key_for(i)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        fields = agnostic_fields("adopted/model", dtype="float16", groups=[])
        adopted_ns = namespace_for(fields)
        cfg_file = root / config_path(adopted_ns)
        cfg_file.parent.mkdir(parents=True, exist_ok=True)
        cfg_file.write_text(json.dumps(fields))
        bogus_ns = "bogus_model_0123456789ab"
        (root / bogus_ns).mkdir()
        (root / config_path(bogus_ns)).write_text(json.dumps(fields))  # fields do not hash to the name
        (root / "README.txt").write_text("not a block")
        temp = root / key_for(5)
        temp = temp.parent / ".kvgate-tmp-deadbeef"
        temp.write_bytes(b"torn")

        gw.start()
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            s = stats(c)
            exp_blocks = N - len(gone) + len(added)
            exp_bytes = expected_bytes - sum(len(body(i)) for i in gone) + sum(len(d) for d in added.values())
            assert (s["blocks"], s["usage_bytes"]) == (exp_blocks, exp_bytes)
            for i in gone:
                assert c.head(f"/v1/blocks/{key_for(i)}").status_code == 404
                assert c.get(f"/v1/blocks/{key_for(i)}").status_code == 404
            for i, data in added.items():
                g = c.get(f"/v1/blocks/{key_for(i)}")
                assert g.status_code == 200 and g.content == data
                assert matches(g.headers["etag"], data)
            look = c.post("/v1/lookup", json={"keys": [key_for(i) for i in [1, 2, 3, 10, 4]]}).json()
            assert look["prefix"] == 3
            assert c.get(f"/v1/namespaces/{adopted_ns}/config").json() == fields
            assert c.get(f"/v1/namespaces/{bogus_ns}/config").status_code == 404
        assert not temp.exists()
        assert (root / "README.txt").exists() and (root / config_path(bogus_ns)).exists()  # left alone
        assert index_rows(gw.data_dir) == block_files(gw.data_dir)
    finally:
        gw.stop()
