"""vLLM 0.33's own event classes decode the gateway's ZMQ stream: store, overwrite, delete, evict, replay; each
payload is byte for byte what vLLM's encoder makes of it; the medium routers know (STORAGE), locality and ownership
unset as an engine's own events; the topic names the pool and the run's model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.events.wire import EventCodec, WireFormat
from tests.conftest import TEST_NS, agnostic_fields, crc, key_for
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
        "medium": "STORAGE",
        "group_idx": 0,
        "lora_name": None,
        "locality": None,
        "ownership": None,
    }


def removed(key: str) -> dict[str, Any]:
    return {
        "type": "BlockRemoved",
        "block_hashes": [h64(key)],
        "medium": "STORAGE",
        "group_idx": 0,
        "locality": None,
        "ownership": None,
    }


def test_vllm_classes_decode_store_overwrite_delete_evict_and_replay(vllm_python: str, tmp_path: Path) -> None:
    # room for 3 blocks; a 4th PUT evicts down to 2 (low watermark 0.7 of 6144 > 4096), background eviction never
    env = {"KVGATE_MAX_BYTES": str(3 * BLOCK), "KVGATE_HIGH_WATERMARK": "1.0", "KVGATE_LOW_WATERMARK": "0.7"}
    gw = events_gateway(tmp_path / "data", env=env).start()
    a, b, c, d, e = (key_for(i) for i in range(5))
    parent_hex = hashlib.sha256(b"parent").hexdigest()
    try:
        first = hello(gw.url)["next_seq"]
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            fields = agnostic_fields(
                "test-org/test-model", dtype="bfloat16", groups=[{"tokens_per_block": 16, "layer_names": ["layer.0"]}]
            )
            assert http.put(f"/v1/namespaces/{TEST_NS}/config", json=fields).status_code in (200, 201)
            meta = {"X-KVGate-Block-Meta": f"parent={parent_hex}; tokens=1,2,3,4"}
            # before the subscriber exists: it can only get these from the replay socket
            assert http.put(f"/v1/blocks/{a}", content=b"a" * BLOCK, headers=meta).status_code == 201
            assert http.put(f"/v1/blocks/{b}", content=b"b" * BLOCK).status_code == 201
            over = http.put(f"/v1/blocks/{a}", content=b"A" * BLOCK)  # overwrite: a new version, an event
            assert over.status_code == 200 and over.json()["digest"] == crc(b"A" * BLOCK)
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
            subscribed = hello(gw.url)["next_seq"]  # the batches of ``expected`` are numbered below it
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
        assert all(got["exact"])  # each payload is what vLLM's own encoder writes for it
        assert set(got["topics"]) == {"kv@pool:kvgate@test-org/test-model"}  # the model name from the config
        before = [seq for seq in got["seqs"] if seq < subscribed]  # a round may put several events in one batch
        assert before and set(before) <= set(got["replayed"])  # the batches before it subscribed came by replay
    finally:
        gw.stop()


ARRAY_CHECK = """
import json, sys
import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored

out = []
for encoding, kind, hex_bytes in json.load(sys.stdin):
    raw = bytes.fromhex(hex_bytes)
    cls = BlockStored if kind == "stored" else BlockRemoved
    value = msgspec.msgpack.decode(raw)
    if encoding == "map":  # vLLM's own class decodes it
        fields = msgspec.structs.asdict(msgspec.msgpack.decode(raw, type=cls))
        out.append({k: fields[k] for k in value if k != "type"})
    else:  # a tagged array: vLLM 0.33's fields by position, trailing defaults left out
        names = [f.name for f in msgspec.structs.fields(cls)]
        out.append({"tag": value[0], **dict(zip(names, value[1:]))})
print(json.dumps(out))
"""


def test_array_encoding_has_vllms_fields_in_vllms_positions(vllm_python: str) -> None:
    encoded = []
    for encoding in ("map", "array"):
        codec = EventCodec(WireFormat(encoding=encoding, locality="REMOTE", ownership="kvgate"))  # every field set
        stored_ = codec.encode(kind="stored", block_hash="ab" * 32, group=3, token_ids=[5, 6], parent="cd" * 16)
        removed_ = codec.encode(kind="removed", block_hash="ab" * 16, group=1)
        encoded += [(encoding, "stored", stored_.hex()), (encoding, "removed", removed_.hex())]
    proc = subprocess.run(
        [vllm_python, "-c", ARRAY_CHECK],
        input=json.dumps(encoded),
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    map_stored, map_removed, array_stored, array_removed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert array_stored.pop("tag") == "BlockStored" and array_removed.pop("tag") == "BlockRemoved"
    # the map holds the fields set; the array the same values at vLLM's positions (extra_keys & co. as None)
    assert {k: v for k, v in array_stored.items() if v is not None} == {
        k: v for k, v in map_stored.items() if v is not None
    }
    assert array_stored["block_size"] == 2 and array_stored["ownership"] == "kvgate"
    assert array_stored["parent_block_hash"] == int("cd" * 8, 16)
    assert array_removed == map_removed
