"""BlockService through its routes, in process: lookup, namespace configs, purge, concurrent writers of one key, and
a restart over the same store and index (usage reloaded, nothing lost)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from app.core.reconcile import reconcile
from app.errors import CommitUnknown, IndexUnavailable
from app.storage.checksums import checksum_of
from contract.keys import namespace_for, run_fields
from contract.wire import SHA256
from tests.conftest import TEST_NS, agnostic_fields, crc, crc_header, key_for, random_bytes, sha
from tests.inprocess.harness import InProcessGateway, running, settings_for

OTHER_NS = "other_model_0123456789ab"


async def test_lookup_is_the_present_prefix(gw: InProcessGateway) -> None:
    c = gw.client
    for i in (0, 1, 3):
        assert (await c.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(100 + i, i))).status_code == 201
    r = await c.post("/v1/lookup", json={"keys": [key_for(i) for i in range(5)]})
    assert r.status_code == 200
    body = r.json()
    assert body["prefix"] == 2
    assert [b["present"] for b in body["blocks"]] == [True, True, False, True, False]
    assert [b.get("size") for b in body["blocks"][:2]] == [100, 101]
    assert (await c.post("/v1/lookup", json={"keys": []})).json()["prefix"] == 0
    bad = await c.post("/v1/lookup", json={"keys": ["garbage"]})
    assert bad.status_code == 400
    stats = await gw.stats()
    assert stats["hits"] == 0 and stats["misses"] == 0  # a lookup is not a read


async def test_lookup_key_bound(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, max_lookup_keys=3)) as gw:
        assert (await gw.client.post("/v1/lookup", json={"keys": [key_for(i) for i in range(3)]})).status_code == 200
        r = await gw.client.post("/v1/lookup", json={"keys": [key_for(i) for i in range(4)]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text


async def test_namespace_config(gw: InProcessGateway) -> None:
    c = gw.client
    fields = run_fields(
        model_name="org/m", tokens_per_hash=16, blocks_per_file=1, tp_size=2, pp_size=1, pcp_size=1, dcp_size=1,
        dtype="float16",
    )  # fmt: skip
    ns = namespace_for(fields)
    assert (await c.put(f"/v1/namespaces/{ns}/config", json=fields)).status_code == 201
    assert (await c.put(f"/v1/namespaces/{ns}/config", json=fields)).status_code == 200
    got = await c.get(f"/v1/namespaces/{ns}/config")
    assert got.status_code == 200 and got.json() == fields
    mismatch = await c.put(f"/v1/namespaces/{ns}/config", json={**fields, "tp_size": 4})
    assert mismatch.status_code == 409 and mismatch.json()["error"]["code"] == "conflict"
    assert (await c.get(f"/v1/namespaces/{ns}/config")).json() == fields
    assert (await c.get("/v1/namespaces/org_m_000000000000/config")).status_code == 404


async def test_purge_removes_one_namespace(fs_gw: InProcessGateway, tmp_path: Path) -> None:
    c = fs_gw.client
    fields = agnostic_fields("test-org/test-model")
    assert namespace_for(fields) == TEST_NS
    assert (await c.put(f"/v1/namespaces/{TEST_NS}/config", json=fields)).status_code == 201
    mine = {key_for(i): random_bytes(1000 + i, i) for i in range(5)}
    theirs = {key_for(i, namespace=OTHER_NS): random_bytes(500, 50 + i) for i in range(3)}
    for key, data in (mine | theirs).items():
        assert (await c.put(f"/v1/blocks/{key}", content=data)).status_code == 201
    r = await c.delete(f"/v1/namespaces/{TEST_NS}")
    assert r.status_code == 200
    assert r.json() == {
        "namespace": TEST_NS,
        "blocks": 5,
        "bytes": sum(len(v) for v in mine.values()),
        "config": True,
    }
    for key in mine:
        assert (await c.head(f"/v1/blocks/{key}")).status_code == 404
        assert not (tmp_path / "blocks" / key).exists()
    for key, data in theirs.items():
        assert (await c.get(f"/v1/blocks/{key}")).content == data
    assert (await c.get(f"/v1/namespaces/{TEST_NS}/config")).status_code == 404
    stats = await fs_gw.stats()
    assert (stats["blocks"], stats["usage_bytes"]) == (3, 1500)
    names = {n["namespace"] for n in (await c.get("/v1/namespaces")).json()["namespaces"]}
    assert names == {OTHER_NS}
    again = await c.delete(f"/v1/namespaces/{TEST_NS}")
    assert again.status_code == 404 and again.json()["error"]["code"] == "namespace_not_found"


async def test_concurrent_writers_of_one_key_leave_one_whole_version(fs_gw: InProcessGateway, tmp_path: Path) -> None:
    key = key_for(7)
    versions = [random_bytes(20_000 + 1000 * n, 70 + n) for n in range(8)]
    results = await asyncio.gather(*(fs_gw.client.put(f"/v1/blocks/{key}", content=v) for v in versions))
    assert all(r.status_code in (200, 201) for r in results), [r.text for r in results]
    got = await fs_gw.client.get(f"/v1/blocks/{key}")
    assert got.content in versions
    assert got.headers["etag"] == f'"{crc(got.content)}"'  # the body is the one its row names
    assert (tmp_path / "blocks" / key).read_bytes() == got.content
    stats = await fs_gw.stats()
    assert (stats["blocks"], stats["usage_bytes"]) == (1, len(got.content))


async def test_restart_over_the_same_store_and_index(tmp_path: Path) -> None:
    cfg = settings_for(tmp_path, fs=True)
    blocks = {key_for(i): random_bytes(3000 + i, i) for i in range(4)}
    async with running(cfg) as gw:
        for key, data in blocks.items():
            assert (await gw.client.put(f"/v1/blocks/{key}", content=data)).status_code == 201
        assert (await gw.client.delete(f"/v1/blocks/{key_for(0)}")).status_code == 204
    del blocks[key_for(0)]
    async with running(cfg) as gw:
        stats = await gw.stats()
        assert (stats["blocks"], stats["usage_bytes"]) == (3, sum(len(v) for v in blocks.values()))
        for key, data in blocks.items():
            got = await gw.client.get(f"/v1/blocks/{key}")
            assert got.content == data and got.headers["etag"] == f'"{crc(data)}"'
        assert (await gw.client.head(f"/v1/blocks/{key_for(0)}")).status_code == 404


async def test_reconcile_adopts_and_forgets(tmp_path: Path) -> None:
    cfg = settings_for(tmp_path, fs=True)
    async with running(cfg) as gw:
        for i in range(3):
            assert (await gw.client.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(500, i))).status_code == 201
    root = tmp_path / "blocks"
    (root / key_for(0)).unlink()  # a file gone behind the gateway's back: its row goes
    adopted = random_bytes(700, 9)
    (root / key_for(9)).parent.mkdir(parents=True, exist_ok=True)
    (root / key_for(9)).write_bytes(adopted)  # a file without a row: adopted
    async with running(cfg) as gw:
        assert (await gw.client.head(f"/v1/blocks/{key_for(0)}")).status_code == 404
        got = await gw.client.get(f"/v1/blocks/{key_for(9)}")
        assert got.status_code == 200 and got.content == adopted and got.headers["etag"] == f'"{crc(adopted)}"'
        stats = await gw.stats()
        assert (stats["blocks"], stats["usage_bytes"]) == (3, 500 * 2 + 700)


async def test_reconcile_checks_a_row_in_its_own_algorithm(tmp_path: Path) -> None:
    """A sha256 row and a CRC64NVME row whose files were touched (a new mtime: the version stamp no longer fits)
    are found intact by recovery, which hashes each in its row's algorithm: kept, re-stamped, still that checksum;
    a rotten one is removed."""
    cfg = settings_for(tmp_path, fs=True)
    signed, plain, rotten = random_bytes(3000, 1), random_bytes(4000, 2), random_bytes(5000, 3)
    async with running(cfg) as gw:
        sha_header = {"X-KVGate-Checksum": checksum_of(signed, SHA256).header}
        assert (await gw.client.put(f"/v1/blocks/{key_for(1)}", content=signed, headers=sha_header)).status_code == 201
        assert (await gw.client.put(f"/v1/blocks/{key_for(2)}", content=plain)).status_code == 201
        assert (await gw.client.put(f"/v1/blocks/{key_for(3)}", content=rotten)).status_code == 201
    root = tmp_path / "blocks"
    for i in (1, 2):
        os.utime(root / key_for(i), (time.time() + 5, time.time() + 5))
    (root / key_for(3)).write_bytes(rotten[:-1] + b"?")
    async with running(cfg) as gw:
        got = await gw.client.get(f"/v1/blocks/{key_for(1)}")
        assert got.content == signed and got.headers["etag"] == f'"{sha(signed)}"'
        got = await gw.client.get(f"/v1/blocks/{key_for(2)}")
        assert got.content == plain and got.headers["etag"] == f'"{crc(plain)}"'
        assert (await gw.client.get(f"/v1/blocks/{key_for(3)}")).status_code == 404
        part = await gw.client.get(f"/v1/blocks/{key_for(2)}", headers={"Range": "bytes=10-2999"})
        assert part.content == plain[10:3000] and part.headers["x-kvgate-range-checksum"] == crc_header(plain[10:3000])


async def test_puts_that_come_together_make_one_layout_lookup(gw: InProcessGateway) -> None:
    """The layout check's lookup of a namespace without a config, shared by the PUTs that need it at once (each
    one's own lookup opened an overflow connection of the async engine's pool past the fifth)."""
    index = gw.core.index  # the service's own (app/core/assembly.py)
    real = index.get_namespace
    asked: list[str] = []

    async def counting(namespace: str) -> object:
        asked.append(namespace)
        await asyncio.sleep(0.05)  # a lookup that takes a moment: every PUT below comes meanwhile
        return await real(namespace)

    index.get_namespace = counting  # type: ignore[method-assign]
    try:
        bodies = [random_bytes(64, i) for i in range(16)]
        got = await asyncio.gather(
            *(gw.client.put(f"/v1/blocks/{key_for(100 + i)}", content=bodies[i]) for i in range(16))
        )
    finally:
        index.get_namespace = real  # type: ignore[method-assign]
    assert [r.status_code for r in got] == [201] * 16
    assert asked == [TEST_NS]
    for i in range(16):
        assert (await gw.client.get(f"/v1/blocks/{key_for(100 + i)}")).content == bodies[i]


async def test_reconcile_defers_a_key_whose_commit_reply_was_lost_and_settles_the_rest(tmp_path: Path) -> None:
    """One key's lost COMMIT reply (CommitUnknown) with the index out a moment longer (the row cannot be read back
    to settle it) defers that key alone: the others are adopted, the report says one was deferred, and the next
    reconcile finds the key as it is. Before: the whole reconcile failed at that key, and a start-up began it again
    from the listing."""
    cfg = settings_for(tmp_path, fs=True, reconcile_on_start=False)
    root = tmp_path / "blocks"
    bodies = {i: random_bytes(600 + i, i) for i in range(6)}
    for i, data in bodies.items():  # files without rows: adopted by reconcile
        (root / key_for(i)).parent.mkdir(parents=True, exist_ok=True)
        (root / key_for(i)).write_bytes(data)
    async with running(cfg) as gw:
        core = gw.core
        index = core.index
        real, real_settled = index.swap_block, index.settled
        lost = key_for(3)

        async def losing(record: Any, **kw: Any) -> Any:
            result = await real(record, **kw)
            if record.key == lost:  # committed, but the reply never came
                raise CommitUnknown("the COMMIT's reply was lost", result=result)
            return result

        async def out(key: str) -> Any:
            if key == lost:
                raise IndexUnavailable("the index cannot be reached")
            return await real_settled(key)

        index.swap_block, index.settled = losing, out  # type: ignore[method-assign]
        try:
            report = await reconcile(upkeep=core.upkeep, store=core.store, index=index)
        finally:
            index.swap_block, index.settled = real, real_settled  # type: ignore[method-assign]
        assert (report.adopted, report.deferred) == (5, 1)
        again = await reconcile(upkeep=core.upkeep, store=core.store, index=index)
        assert again.deferred == 0
        for i, data in bodies.items():
            got = await gw.client.get(f"/v1/blocks/{key_for(i)}")
            assert got.status_code == 200 and got.content == data and got.headers["etag"] == f'"{crc(data)}"'
        stats = await gw.stats()
        assert stats["blocks"] == 6


async def test_reconcile_defers_a_config_and_the_idle_uploads_and_finishes_the_rest(tmp_path: Path) -> None:
    """Its tail steps defer as its per-key ones do: one namespace config whose row cannot be written (the index out
    a moment), and the sweeps of idle uploads and of part objects (the index's uploads unreadable), are each left
    for the next reconcile and counted in ``deferred``; the other config is adopted and the report comes back.
    Before: the first failure ended the whole reconcile (a start-up one began it again from the listing)."""
    cfg = settings_for(tmp_path, fs=True, reconcile_on_start=False)
    root = tmp_path / "blocks"
    fields = {name: agnostic_fields(name) for name in ("test-org/config-a", "test-org/config-b")}
    names = {name: namespace_for(f) for name, f in fields.items()}
    for name, f in fields.items():  # configs without rows: adopted by reconcile
        (root / names[name]).mkdir(parents=True, exist_ok=True)
        (root / names[name] / "config.json").write_text(json.dumps(f))
    async with running(cfg) as gw:
        core = gw.core
        index = core.index
        real_put, real_uploads = index.put_namespace, index.scans.uploads
        flaky = names["test-org/config-b"]

        async def put_namespace(*, name: str, fields: Any) -> Any:
            if name == flaky:
                raise IndexUnavailable("the index cannot be reached")
            return await real_put(name=name, fields=fields)

        async def uploads() -> Any:
            raise IndexUnavailable("the index cannot be reached")

        index.put_namespace, index.scans.uploads = put_namespace, uploads  # type: ignore[method-assign]
        try:
            report = await reconcile(upkeep=core.upkeep, store=core.store, index=index)
        finally:
            index.put_namespace, index.scans.uploads = real_put, real_uploads  # type: ignore[method-assign]
        assert (report.configs_adopted, report.deferred) == (1, 3)  # a config, two sweeps
        again = await reconcile(upkeep=core.upkeep, store=core.store, index=index)
        assert (again.configs_adopted, again.deferred) == (1, 0)
        for name, f in fields.items():
            got = await gw.client.get(f"/v1/namespaces/{names[name]}/config")
            assert got.status_code == 200 and got.json()["model_name"] == f["model_name"]
