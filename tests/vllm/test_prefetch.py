"""Fetch at arrival with a KVGateConnector built by the real vLLM 0.33.0 (tests/vllm/oracle_prefetch.py, in the oracle
venv), without an engine, through a real gateway whose request counter says when the block GETs happened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gateway import Gateway
from tests.vllm.test_interop import TINY_LLAMA, oracle, result

pytestmark = pytest.mark.vllm
PROMPT_BLOCKS = 3


def test_a_waiting_requests_blocks_are_in_host_memory_before_it_is_admitted(
    vllm_python: str, gateway: Gateway, tmp_path: Path
) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    got = result(oracle(vllm_python, "oracle_prefetch.py", gateway.url, str(model)))
    assert got["hook"] is True  # vLLM's Scheduler.add_request calls on_new_request
    assert got["stored"] == PROMPT_BLOCKS
    whole = PROMPT_BLOCKS * got["block_bytes"]
    # before admission: the prefetch was shipped by idle steps, the gateway served its GETs, the bytes are held
    assert got["shipped"] == [["q", PROMPT_BLOCKS]]
    assert got["gets_before_admission"] == PROMPT_BLOCKS
    assert got["held_before_admission"] == whole
    early = got["stats_before_admission"]  # the metric: prefetched bytes held, before the scheduler admitted it
    assert early["prefetch_bytes_held"] == whole and early["prefetch_started"] == 1
    assert early["prefetch_blocks"] == PROMPT_BLOCKS and "loaded_blocks" not in early
    # admission: answered at once, one load, no GET of its own, the KV bytes are the stored ones
    assert got["matched"] == [PROMPT_BLOCKS * 16, True]
    assert got["loads"] == [["q", PROMPT_BLOCKS]]
    assert got["recving"] == ["q"] and got["errors"] == []
    assert got["gets_after_load"] == PROMPT_BLOCKS
    assert got["equal"] is True
    ws = got["worker_stats"]
    assert ws["prefetch_hits"] == 1 and ws["prefetch_used"] == 1 and ws["loaded_blocks"] == PROMPT_BLOCKS
    assert ws["prefetch_bytes_held"] == 0 and "loaded_bytes" not in ws  # no byte of the load crossed the network
    # an aborted waiting request: its prefetched bytes are dropped, the gauge goes back to 0
    assert got["abort_shipped"] == [["a", PROMPT_BLOCKS]] and got["abort_held"] == whole
    assert got["abort_stats_held"]["prefetch_bytes_held"] == whole
    assert got["drops"] == ["a"]
    ab = got["abort_stats"]
    assert ab["prefetch_dropped"] == 1 and ab["prefetch_bytes_held"] == 0 and "prefetch_used" not in ab
    assert got["sched_stats"]["prefetches"] == 2 and got["sched_stats"]["loads"] == 1
