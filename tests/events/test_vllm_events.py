"""vLLM 0.33's own event classes decode the gateway's ZMQ stream: store, overwrite, delete, evict, replay."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import key_for
from tests.events.helpers import events_gateway, hello
from tests.gateway import REPO

pytestmark = pytest.mark.vllm
HERE = Path(__file__).parent
BLOCK = 2048


def h64(key: str) -> int:
    """The block hash of a key as vLLM's events carry it by default: the low 64 bits, as an int."""
    return int(key.rsplit("/", 1)[1].removesuffix(".bin")[-16:], 16)


def stored(key: str, *, tokens: list[int] | None = None, parent: str | None = None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [h64(key)],
        "parent_block_hash": h64(parent) if parent else None,
        "token_ids": tokens or [],
        "block_size": len(tokens or []),
        "medium": "kvgate",
        "group_idx": 0,
        "lora_name": None,
    }


def removed(key: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [h64(key)], "medium": "kvgate", "group_idx": 0}


def test_vllm_classes_decode_store_overwrite_delete_evict_and_replay(vllm_python: str, tmp_path: Path) -> None:
    # room for 3 blocks; a 4th PUT evicts down to 2 (low watermark 0.7 of 6144 > 4096), background eviction never
    env = {"KVGATE_MAX_BYTES": str(3 * BLOCK), "KVGATE_HIGH_WATERMARK": "1.0", "KVGATE_LOW_WATERMARK": "0.7"}
    gw = events_gateway(tmp_path / "data", env=env).start()
    a, b, c, d, e = (key_for(i) for i in range(5))
    parent_hex = hashlib.sha256(b"parent").hexdigest()
    try:
        first = hello(gw.url)["next_seq"]
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            meta = {"X-KVGate-Block-Meta": f"parent={parent_hex}; tokens=1,2,3,4"}
            # before the subscriber exists: it can only get these from the replay socket
            assert http.put(f"/v1/blocks/{a}", content=b"a" * BLOCK, headers=meta).status_code == 201
            assert http.put(f"/v1/blocks/{b}", content=b"b" * BLOCK).status_code == 201
            over = http.put(f"/v1/blocks/{a}", content=b"A" * BLOCK)  # overwrite: a new version, an event
            assert over.status_code == 200 and over.json()["digest"] == hashlib.sha256(b"A" * BLOCK).hexdigest()
            assert http.put(f"/v1/blocks/{a}", content=b"A" * BLOCK).status_code == 200  # same bytes: no event
            assert http.delete(f"/v1/blocks/{b}").status_code == 204
            assert http.put(f"/v1/blocks/{b}", content=b"x" * 10, headers={"If-None-Match": "x"}).status_code == 400
            expected = [
                stored(a, tokens=[1, 2, 3, 4], parent=f"x/{parent_hex}.bin"),
                stored(b),
                stored(a),
                removed(b),
            ]
            later = [stored(c), stored(d), removed(a), stored(e)]
            proc = subprocess.Popen(
                [
                    vllm_python,
                    str(HERE / "vllm_subscriber.py"),
                    gw.pub,
                    gw.replay,
                    str(first),
                    str(len(expected + later)),
                ],  # type: ignore[attr-defined]
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
                cwd=REPO,
            )
            try:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line.strip() == "ready", proc.stderr.read() if proc.stderr else line
                for key in (c, d, e):  # the third fills the store: a, least recently used, is evicted first
                    assert http.put(f"/v1/blocks/{key}", content=b"c" * BLOCK).status_code == 201
                assert http.head(f"/v1/blocks/{a}").status_code == 404
                out, err = proc.communicate(timeout=180)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["events"] == expected + later
        assert got["seqs"] == list(range(first, first + len(got["seqs"])))
        assert set(got["seqs"][:4]) <= set(got["replayed"])  # the batches before it subscribed came by replay
    finally:
        gw.stop()
