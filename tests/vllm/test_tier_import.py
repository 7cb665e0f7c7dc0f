"""``kvgate import DIR`` without vLLM: a directory laid out as vLLM's fs tier lays it out (FileMapper names,
``json.dump(fields, indent=2, sort_keys=True)`` config, a torn ``*.tmp`` file) is adopted and served byte for byte.
The same check against files written by the real fs tier is in test_tier_interop.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from contract.keys import config_path, namespace_for
from tests.conftest import agnostic_fields, key_for, matches, random_bytes
from tests.gateway import Gateway
from tests.vllm.tier_harness import kvgate_import

FIELDS = agnostic_fields(
    "org/import-model", dtype="bfloat16", groups=[{"tokens_per_block": 16, "layer_names": ["layer.0"]}]
)
NS = namespace_for(FIELDS)


def make_fs_dir(root: Path, n: int) -> dict[str, bytes]:
    blocks = {key_for(i, namespace=NS): random_bytes(4096 + i, seed=i) for i in range(n)}
    for key, data in blocks.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    (root / config_path(NS)).parent.mkdir(parents=True, exist_ok=True)
    (root / config_path(NS)).write_text(json.dumps(FIELDS, indent=2, sort_keys=True))
    (root / (key_for(0, namespace=NS) + "_42.tmp")).write_bytes(b"torn")
    (root / "notes.txt").write_text("not a key")
    return blocks


def test_import_copies_an_fs_tier_directory_and_is_idempotent(tmp_path: Path) -> None:
    src = tmp_path / "fs-root"
    blocks = make_fs_dir(src, 5)
    data = tmp_path / "gw"
    first = kvgate_import(src, data)
    assert (first["in_place"], first["blocks"], first["namespaces"], first["skipped"], first["failed"]) == (
        False, 5, 1, 2, 0,
    )  # fmt: skip
    again = kvgate_import(src, data)
    assert (again["blocks"], again["already_indexed"]) == (0, 5)
    gw = Gateway(data, env={"KVGATE_RECONCILE_ON_START": "false"}).start()
    try:
        with httpx.Client(base_url=gw.url, timeout=10.0) as c:
            assert c.post("/v1/lookup", json={"keys": list(blocks)}).json()["prefix"] == 5
            for key, body in blocks.items():
                r = c.get(f"/v1/blocks/{key}")
                assert (r.status_code, r.content) == (200, body) and matches(r.headers["etag"], body)
            assert c.get(f"/v1/namespaces/{NS}/config").json() == FIELDS
    finally:
        gw.stop()
    assert (data / "blocks" / config_path(NS)).read_bytes() == (src / config_path(NS)).read_bytes()


def test_import_rejects_a_config_whose_fields_do_not_match_its_name(tmp_path: Path) -> None:
    src = tmp_path / "fs-root"
    make_fs_dir(src, 1)
    (src / config_path(NS)).write_text(json.dumps({**FIELDS, "tp_size": 2}, indent=2, sort_keys=True))
    report = kvgate_import(src, tmp_path / "gw", expect_rc=1)
    assert (report["failed"], report["namespaces"], report["blocks"]) == (1, 0, 1)
