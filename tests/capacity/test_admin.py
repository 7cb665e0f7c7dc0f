"""Admin plane: namespaces, stats, purge, OpenAPI; and a 1,000-key lookup."""

from __future__ import annotations

from pathlib import Path

import httpx

from contract.keys import config_path, namespace_for
from tests.capacity.helpers import block_files, index_rows
from tests.conftest import TEST_NS, agnostic_fields, key_for, matches
from tests.gateway import Gateway, settled_stats

FIELDS = agnostic_fields("admin/model", dtype="float16", groups=[])
OTHER = namespace_for(FIELDS)


def test_namespaces_stats_and_purge(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        assert c.get("/v1/namespaces").json() == {"namespaces": []}
        for i in range(10):
            assert c.put(f"/v1/blocks/{key_for(i)}", content=b"t" * 100).status_code == 201
        for i in range(4):
            assert c.put(f"/v1/blocks/{key_for(i, namespace=OTHER)}", content=b"o" * 50).status_code == 201
        assert c.put(f"/v1/namespaces/{OTHER}/config", json=FIELDS).status_code == 201
        for i in range(3):
            assert c.get(f"/v1/blocks/{key_for(i)}").status_code == 200
        assert c.get(f"/v1/blocks/{key_for(0)}").status_code == 200
        assert c.head(f"/v1/blocks/{key_for(5)}").status_code == 200  # HEAD is not a read: never_read stays
        assert c.get(f"/v1/blocks/{key_for(99)}").status_code == 404

        listed = {n["namespace"]: n for n in c.get("/v1/namespaces").json()["namespaces"]}
        assert set(listed) == {TEST_NS, OTHER}
        t = listed[TEST_NS]
        assert (t["blocks"], t["bytes"], t["hits"], t["has_config"]) == (10, 1000, 4, False)
        assert t["never_read_ratio"] == 0.7
        o = listed[OTHER]
        assert (o["blocks"], o["bytes"], o["hits"], o["never_read_ratio"], o["has_config"]) == (4, 200, 0, 1.0, True)
        assert o["last_write"] is not None
        assert c.get(f"/v1/namespaces/{OTHER}").json() == o
        assert c.get("/v1/namespaces/nope_model_0123456789ab").status_code == 404
        assert c.get("/v1/namespaces/..bad").status_code == 400

        s = c.get("/v1/stats").json()
        assert (s["blocks"], s["usage_bytes"], s["namespaces"], s["max_bytes"]) == (14, 1200, 2, None)
        assert (s["hits"], s["misses"], s["evictions"]) == (5, 1, 0)
        assert s["uptime_s"] > 0

        purge = c.delete(f"/v1/namespaces/{OTHER}")
        assert purge.status_code == 200
        assert purge.json() == {"namespace": OTHER, "blocks": 4, "bytes": 200, "config": True}
        assert c.delete(f"/v1/namespaces/{OTHER}").status_code == 404
        for i in range(4):
            assert c.head(f"/v1/blocks/{key_for(i, namespace=OTHER)}").status_code == 404
        assert c.get(f"/v1/namespaces/{OTHER}/config").status_code == 404
        assert not (gateway.data_dir / "blocks" / config_path(OTHER)).exists()
        s = c.get("/v1/stats").json()
        assert (s["blocks"], s["usage_bytes"], s["namespaces"]) == (10, 1000, 1)
        assert c.head(f"/v1/blocks/{key_for(0)}").status_code == 200  # the other namespace is untouched
    assert index_rows(gateway.data_dir) == block_files(gateway.data_dir)


def test_lookup_of_1000_keys(tmp_path: Path) -> None:
    keys = [key_for(i) for i in range(1000)]
    gw = Gateway(tmp_path / "data")
    for i in [*range(700), 900]:  # laid down as files: the start-up reconcile adopts them (PUTs are tested elsewhere)
        p = gw.data_dir / "blocks" / keys[i]
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(i.to_bytes(4, "big"))
    gw.start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.put(f"/v1/blocks/{keys[950]}", content=b"late").status_code == 201
            r = c.post("/v1/lookup", json={"keys": keys})
            assert r.status_code == 200
            body = r.json()
            assert body["prefix"] == 700
            assert [b["key"] for b in body["blocks"]] == keys
            assert [b["present"] for b in body["blocks"]] == [i < 700 or i in (900, 950) for i in range(1000)]
            assert body["blocks"][5]["size"] == 4 and body["blocks"][950]["size"] == 4
            assert matches(body["blocks"][5]["etag"], (5).to_bytes(4, "big"))
            s = c.get("/v1/stats").json()
            assert (s["hits"], s["misses"]) == (0, 0)  # a lookup is not a read
    finally:
        gw.stop()


def test_admin_routes_documented(gateway: Gateway) -> None:
    spec = httpx.get(f"{gateway.url}/openapi.json").json()
    paths = spec["paths"]
    assert {"200", "503"} <= set(paths["/v1/namespaces"]["get"]["responses"])
    assert {"200", "400", "404", "503"} <= set(paths["/v1/namespaces/{namespace}"]["get"]["responses"])
    assert {"200", "400", "404", "503"} <= set(paths["/v1/namespaces/{namespace}"]["delete"]["responses"])
    assert "$ref" in str(paths["/v1/stats"]["get"]["responses"]["200"])
    schemas = spec["components"]["schemas"]
    assert {"never_read_ratio", "hits", "last_write"} <= set(schemas["NamespaceSummary"]["properties"])
    assert {"usage_bytes", "max_bytes", "evictions", "uptime_s"} <= set(schemas["Stats"]["properties"])
    assert "/metrics" in paths


def test_restart_with_a_bound_evicts_at_start(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data").start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for i in range(20):
                assert c.put(f"/v1/blocks/{key_for(i)}", content=b"x" * 1000).status_code == 201
        gw.stop()
        gw.extra_env["KVGATE_MAX_BYTES"] = "10000"  # the bound shrinks: the first round evicts to the low mark
        gw.start()
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            s = settled_stats(c)
            assert s["usage_bytes"] <= 9500 and s["evictions"] >= 10
            assert c.head(f"/v1/blocks/{key_for(19)}").status_code == 200
            assert c.head(f"/v1/blocks/{key_for(0)}").status_code == 404
    finally:
        gw.stop()
