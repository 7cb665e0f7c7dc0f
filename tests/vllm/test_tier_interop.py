"""Byte compatibility with vLLM 0.33's fs tier, both ways, through the real fs-tier read and write paths."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import matches
from tests.gateway import Gateway
from tests.vllm.tier_harness import kvgate_import, rows, run_driver

pytestmark = pytest.mark.vllm


def assert_served(gw: Gateway, paths: list[str], expected: list[bytes], run_config: dict[str, object]) -> None:
    with httpx.Client(base_url=gw.url, timeout=10.0) as c:
        found = c.post("/v1/lookup", json={"keys": paths}).json()
        assert found["prefix"] == len(paths)
        for path, data in zip(paths, expected, strict=True):
            r = c.get(f"/v1/blocks/{path}")
            assert r.status_code == 200
            assert r.content == data
            assert matches(r.headers["etag"], data)
        namespace = paths[0].split("_r0/")[0]
        assert c.get(f"/v1/namespaces/{namespace}/config").json() == run_config


def test_fs_tier_directory_is_served_by_kvgate_after_import(vllm_python: str, tmp_path: Path) -> None:
    vllm_root = tmp_path / "vllm-fs-root"
    out = tmp_path / "out"
    report = run_driver(vllm_python, "fs-write", out, root=vllm_root)
    assert report["store"]["1001"]["success"] is True
    written = rows(out, count=6)
    paths: list[str] = report["paths"]
    (vllm_root / paths[0]).with_name("leftover.bin_123.tmp").write_bytes(b"torn")  # an interrupted vLLM write

    # Copy mode: into a fresh gateway's data root.
    data = tmp_path / "gw-copy"
    imported = kvgate_import(vllm_root, data)
    assert (imported["in_place"], imported["blocks"], imported["namespaces"]) == (False, 6, 1)
    assert (imported["skipped"], imported["failed"]) == (1, 0)
    assert kvgate_import(vllm_root, data)["already_indexed"] == 6  # idempotent
    gw = Gateway(data, env={"KVGATE_RECONCILE_ON_START": "false"}).start()
    try:
        assert_served(gw, paths, written, report["run_config"])
        config = (data / "blocks" / report["config_path"]).read_bytes()
        assert config == (vllm_root / report["config_path"]).read_bytes()
    finally:
        gw.stop()

    # In place: the fs tier's directory IS the gateway's data root; nothing is copied, only indexed.
    data2 = tmp_path / "gw-in-place"
    env = {"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__ROOT": str(vllm_root), "KVGATE_RECONCILE_ON_START": "false"}
    imported = kvgate_import(vllm_root, data2, env=env)
    assert (imported["in_place"], imported["blocks"], imported["failed"]) == (True, 6, 0)
    gw = Gateway(data2, env=env).start()
    try:
        assert_served(gw, paths, written, report["run_config"])
    finally:
        gw.stop()


def test_kvgate_data_root_is_read_by_vllm_fs_tier(vllm_python: str, gateway: Gateway, tmp_path: Path) -> None:
    report = run_driver(
        vllm_python, "kvgate-then-fs", tmp_path / "out", url=gateway.url, root=gateway.data_dir / "blocks"
    )
    assert report["store"]["1001"]["success"] is True
    # vLLM's fs tier, pointed at <data_dir>/blocks, finds every row and reads it back byte for byte.
    assert report["fs_lookup"][0] == ["HIT"] * 5
    assert report["fs_load"]["1001"]["success"] is True
    assert report["fs_equal"] == [True] * 5
    # The gateway wrote config.json with the very bytes vLLM's fs tier writes, so the tier left it alone.
    assert report["config_before"] == report["config_vllm"] == report["config_after"]
