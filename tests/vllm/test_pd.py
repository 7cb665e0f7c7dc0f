"""Prefill/decode disaggregation through a real gateway: a kv_producer and a kv_consumer KVGateConnector built by
the real vLLM 0.33.0 (tests/vllm/oracle_pd.py, in the oracle venv), without an engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.gateway import Gateway, free_port
from tests.vllm.test_interop import TINY_LLAMA, oracle, result

pytestmark = pytest.mark.vllm
BLOCK, PROMPT_BLOCKS = 16, 3


def run(vllm_python: str, url: str, tmp_path: Path, which: str) -> dict[str, Any]:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    return result(oracle(vllm_python, "oracle_pd.py", url, str(model), which))


def test_producer_hands_its_blocks_to_the_consumer(vllm_python: str, gateway: Gateway, tmp_path: Path) -> None:
    got = run(vllm_python, gateway.url, tmp_path, "handoff")
    p = got["p"]
    assert p["matched"] == [0, False]  # a producer never loads
    assert p["planned"] == PROMPT_BLOCKS and p["stored"] == PROMPT_BLOCKS and all(p["keep"])
    assert p["delay_free"] is True
    params = p["params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["kvgate_url"] == gateway.url and params["kvgate_num_blocks"] == PROMPT_BLOCKS
    assert len(params["kvgate_block_hashes"]) == PROMPT_BLOCKS and params["kvgate_block_size"] == BLOCK
    # P wrote its blocks and its namespace's config, and never looked up nor read
    p_req = got["p_requests"]
    assert p_req.get("PUT /v1/blocks/{path}", 0) == PROMPT_BLOCKS, p_req
    assert not any(k.startswith(("GET", "HEAD")) or "lookup" in k for k in p_req), p_req
    # D's external hit is the prompt's full blocks, loaded byte-equal, and D never wrote
    assert got["d_matched"] == [PROMPT_BLOCKS * BLOCK, True]
    assert got["d"]["loads"] == [PROMPT_BLOCKS] and got["d"]["recving"] == ["d"]
    assert got["equal"] is True
    d_req = got["d_requests"]
    assert d_req.get("POST /v1/lookup", 0) == 1 and d_req.get("GET /v1/blocks/{path}", 0) == PROMPT_BLOCKS
    assert not any(k.startswith(("PUT", "DELETE", "POST /v1/namespaces")) for k in d_req), d_req
    assert not any(k.startswith("PUT") for k in got["d_register"]), got["d_register"]  # no config write either


def test_the_consumers_lookup_waits_for_stores_still_in_flight(
    vllm_python: str, gateway: Gateway, tmp_path: Path
) -> None:
    got = run(vllm_python, gateway.url, tmp_path, "race")
    assert got["p"]["planned"] == PROMPT_BLOCKS and all(got["p"]["keep"])
    assert got["d_first"] == [None, False] and got["d_still_waiting"] == [None, False]  # waiting on the gateway
    assert got["d_matched"] == [PROMPT_BLOCKS * BLOCK, True]  # the full hit, not a miss and a recompute
    assert got["d_waited_s"] < 5.0  # woken by P's stores, before its 5 s wait ran out


def test_blocks_that_never_come_are_recomputed_after_the_wait(
    vllm_python: str, gateway: Gateway, tmp_path: Path
) -> None:
    got = run(vllm_python, gateway.url, tmp_path, "absent")
    assert got["d_matched"] == [0, False]
    assert got["d_waited_s"] >= 5.0  # it waited out its handoff_wait_ms, then answered what is there
    assert got["abandoned_lookups"] == 0  # the gateway's answer, not a lookup given up on


def test_a_gateway_that_is_down_is_a_miss_at_once(vllm_python: str, tmp_path: Path) -> None:
    got = run(vllm_python, f"http://127.0.0.1:{free_port()}", tmp_path, "down")
    assert got["d_matched"] == [0, False]
    assert got["d_waited_s"] < 5.0  # an error, not its 5 s wait
