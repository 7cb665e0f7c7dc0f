"""The OffloadingConnector tier's stores carry each chunk's meta from vLLM's request: the gateway's BlockStored for a
chunk is the one vLLM's own self-describing offloading events publish for it (real vLLM 0.33.0 request, block
hasher, tiering manager and event tracker; the tier through KVGateOffloadingConnector's hand-off)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.events.helpers import ZmqTap, events_gateway, h64, joined
from tests.vllm.tier_harness import run_driver

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_tier_chunks_carry_what_vllms_own_events_say(vllm_python: str, tmp_path: Path, blocks_per_chunk: int) -> None:
    gw = events_gateway(tmp_path / "data").start()
    tap = ZmqTap(gw.pub)  # type: ignore[attr-defined]
    try:
        start = joined(gw.url, tap)
        report = run_driver(vllm_python, "meta", tmp_path / "out", url=gw.url, blocks_per_chunk=blocks_per_chunk)
        announced, plain = report["requests"]
        assert announced["announced"] and announced["success"] == [True] and plain["success"] == [True]
        paths = announced["paths"] + plain["paths"]
        want = {h64(p) for p in paths}
        tap.wait(lambda t: want <= {e["block_hashes"][0] for s, e in t.events() if s >= start})
        ours: dict[int, dict[str, Any]] = {e["block_hashes"][0]: e for s, e in tap.events() if s >= start}

        assert len(announced["vllm_events"]) == len(announced["paths"]) >= 4
        for path, theirs in zip(announced["paths"], announced["vllm_events"], strict=True):
            event = ours[h64(path)]
            if blocks_per_chunk == 1:
                assert event == theirs  # field for field, vLLM's own BlockStored for this chunk
            else:  # vLLM lists the chunk's blocks; the gateway's key names the chunk by its last
                assert event["block_hashes"] == theirs["block_hashes"][-1:]
                assert event["block_size"] == len(theirs["token_ids"]) == blocks_per_chunk * theirs["block_size"]
                same = ("token_ids", "parent_block_hash", "medium", "locality", "ownership", "group_idx", "type")
                assert {k: event.get(k) for k in same} == {k: theirs.get(k) for k in same}  # unset: left out
        assert ours[h64(announced["paths"][0])]["parent_block_hash"] is None
        for path in plain["paths"]:  # under vLLM's own OffloadingConnector the tier is never told the request
            event = ours[h64(path)]
            assert (event["token_ids"], event["parent_block_hash"], event["block_size"]) == ([], None, 0)
    finally:
        tap.close()
        gw.stop()
