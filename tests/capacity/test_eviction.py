"""Capacity bound and LRU eviction, against a real gateway process."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.capacity.helpers import block_files, index_rows
from tests.conftest import key_for, matches, random_bytes
from tests.gateway import Gateway, settled_stats

BLOCK = 64 * 1024
CAPACITY_BLOCKS = 50


def test_fill_past_capacity_keeps_bound_and_hot_blocks(tmp_path: Path) -> None:
    env = {
        "KVGATE_MAX_BYTES": str(CAPACITY_BLOCKS * BLOCK),
        "KVGATE_ACCESS_FLUSH_INTERVAL_S": "0.05",
        "KVGATE_EVICTION_BATCH": "1",  # one block per round: a round in flight is a wide window, not a rare one
    }
    gw = Gateway(tmp_path / "data", env=env).start()
    hot = [0, 1, 2, 3, 4]
    bodies = {i: random_bytes(BLOCK, seed=i) for i in range(200)}
    peak = 0
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for i in range(200):
                r = c.put(f"/v1/blocks/{key_for(i)}", content=bodies[i])
                assert r.status_code == 201, r.text
                usage = c.get("/v1/stats").json()["usage_bytes"]
                peak = max(peak, usage)
                assert usage <= (CAPACITY_BLOCKS + 1) * BLOCK, (i, usage)
                if i >= 10 and i % 5 == 0:  # keep the early ones hot: GET is what extends a block's life
                    for h in hot:
                        g = c.get(f"/v1/blocks/{key_for(h)}")
                        assert g.status_code == 200 and g.content == bodies[h], (i, h, g.status_code)
            stats = settled_stats(c)
            assert stats["evictions"] >= 200 - CAPACITY_BLOCKS
            assert stats["usage_bytes"] == stats["blocks"] * BLOCK <= CAPACITY_BLOCKS * BLOCK
            present = {i for i in range(200) if c.head(f"/v1/blocks/{key_for(i)}").status_code == 200}
            for h in hot:
                assert h in present, f"hot block {h} was evicted"
            assert set(range(195, 200)) <= present  # the newest survive too
            for i in set(range(200)) - present:
                assert c.get(f"/v1/blocks/{key_for(i)}").status_code == 404
            for i in sorted(present)[:20]:
                g = c.get(f"/v1/blocks/{key_for(i)}")
                assert g.status_code == 200 and g.content == bodies[i]
                assert matches(g.headers["etag"], bodies[i])
            assert len(present) == stats["blocks"]
            rows, files = index_rows(gw.data_dir), block_files(gw.data_dir)
            assert rows == files, set(rows) ^ set(files)
            assert set(rows) == {key_for(i) for i in present}
    finally:
        gw.stop()
    assert peak <= CAPACITY_BLOCKS * BLOCK  # admission evicts before the write: the bound itself holds


def test_too_large_for_capacity_is_507(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data", env={"KVGATE_MAX_BYTES": str(4 * BLOCK)}).start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for i in range(3):
                assert c.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(BLOCK, seed=i)).status_code == 201
            r = c.put(f"/v1/blocks/{key_for(99)}", content=b"z" * (4 * BLOCK + 1))
            assert r.status_code == 507
            assert r.json()["error"]["code"] == "insufficient_storage"
            assert c.head(f"/v1/blocks/{key_for(99)}").status_code == 404
            for i in range(3):  # nothing was evicted for a PUT that could never fit
                assert c.head(f"/v1/blocks/{key_for(i)}").status_code == 200
            assert c.get("/v1/stats").json()["evictions"] == 0
    finally:
        gw.stop()
    assert key_for(99) not in block_files(gw.data_dir)


def test_namespace_quota_evicts_only_that_namespace(tmp_path: Path) -> None:
    other = "other_model_0123456789ab"
    gw = Gateway(tmp_path / "data", env={"KVGATE_NAMESPACE_QUOTA_BYTES": str(10 * BLOCK)}).start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for i in range(8):
                assert c.put(f"/v1/blocks/{key_for(i, namespace=other)}", content=b"o" * BLOCK).status_code == 201
            for i in range(30):
                assert c.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(BLOCK, seed=i)).status_code == 201
            ns = {n["namespace"]: n for n in c.get("/v1/namespaces").json()["namespaces"]}
            assert ns[other]["blocks"] == 8  # under its quota: untouched
            from tests.conftest import TEST_NS

            assert ns[TEST_NS]["bytes"] <= 10 * BLOCK
            assert c.head(f"/v1/blocks/{key_for(29)}").status_code == 200
            assert c.head(f"/v1/blocks/{key_for(0)}").status_code == 404
            assert c.put(f"/v1/blocks/{key_for(99)}", content=b"q" * (10 * BLOCK + 1)).status_code == 507
    finally:
        gw.stop()


def test_get_in_progress_completes_when_its_block_is_evicted(tmp_path: Path) -> None:
    big = random_bytes(24 * 1024 * 1024, seed=7)
    env = {"KVGATE_MAX_BYTES": str(40 * 1024 * 1024), "KVGATE_IO_CHUNK_BYTES": str(256 * 1024)}
    gw = Gateway(tmp_path / "data", env=env).start()
    try:
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            assert c.put(f"/v1/blocks/{key_for(1)}", content=big).status_code == 201
            with c.stream("GET", f"/v1/blocks/{key_for(1)}") as resp:
                assert resp.status_code == 200
                chunks = resp.iter_bytes()
                got = bytearray(next(chunks))
                # A second client pushes usage past max_bytes: the block being read is the only candidate.
                with httpx.Client(base_url=gw.url, timeout=60) as c2:
                    assert c2.put(f"/v1/blocks/{key_for(2)}", content=b"n" * (20 * 1024 * 1024)).status_code == 201
                    assert c2.head(f"/v1/blocks/{key_for(1)}").status_code == 404
                    assert key_for(1) not in block_files(gw.data_dir)
                for chunk in chunks:
                    got += chunk
            assert bytes(got) == big
            assert c.get(f"/v1/blocks/{key_for(1)}").status_code == 404
            assert c.get("/v1/stats").json()["evictions"] == 1
    finally:
        gw.stop()


def test_head_and_lookup_do_not_extend_a_blocks_life(tmp_path: Path) -> None:
    env = {"KVGATE_MAX_BYTES": str(10 * BLOCK), "KVGATE_ACCESS_FLUSH_INTERVAL_S": "0.05"}
    gw = Gateway(tmp_path / "data", env=env).start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for i in range(9):
                assert c.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(BLOCK, seed=i)).status_code == 201
            for _ in range(5):
                assert c.head(f"/v1/blocks/{key_for(0)}").status_code == 200
                assert c.post("/v1/lookup", json={"keys": [key_for(0)]}).json()["prefix"] == 1
            assert c.get(f"/v1/blocks/{key_for(1)}").status_code == 200  # only GET makes a block recent
            for i in range(9, 12):
                assert c.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(BLOCK, seed=i)).status_code == 201
            settled_stats(c)
            assert c.head(f"/v1/blocks/{key_for(0)}").status_code == 404  # oldest, HEADs notwithstanding
            assert c.head(f"/v1/blocks/{key_for(1)}").status_code == 200  # read: survived its elders
            assert c.head(f"/v1/blocks/{key_for(2)}").status_code == 404
    finally:
        gw.stop()
