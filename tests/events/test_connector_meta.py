"""The standalone connector's stores carry each block's meta: the gateway's events say the block's token ids and its
parent's hash, as vLLM's own BlockStored does (planner -> plan -> worker pipeline -> PUT -> event), on CPU tensors."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from connector.http.client import BlockClient, ClientConfig
from connector.planning.plan import KeyScheme, SchedulerPlanner
from tests.connector.test_pipeline import BLOCK, full_kv, hashes, pipeline, run_naming, shard
from tests.events.helpers import events_gateway, hello, read_batches


def test_stored_blocks_carry_their_tokens_and_parents(tmp_path: Path) -> None:
    gw = events_gateway(tmp_path / "data").start()
    dtype = torch.bfloat16
    nm = run_naming(tp=1, rank=0, dtype=dtype)
    hs = hashes(80, 5)
    tokens = [1000 + i for i in range(5 * BLOCK + 7)]
    try:
        start = hello(gw.url)["next_seq"]
        with BlockClient(ClientConfig(base_url=gw.url, max_connections=16)) as client:
            planner = SchedulerPlanner(
                client=client, keys=KeyScheme(namings=[nm], num_groups=1), block_size=BLOCK, hash_block_size=BLOCK
            )
            for _ in range(3000):  # None while the lookup is in flight
                got = planner.matched_tokens(
                    req_id="r", block_hashes=hs, num_tokens=len(tokens), num_computed_tokens=0, token_ids=tokens
                )
                if got is not None:
                    break
                time.sleep(0.01)
            assert got == 0
            planner.after_alloc(req_id="r", block_ids=[[10, 11, 12, 13, 14, 15]], num_external_tokens=0)
            planner.scheduled(req_id="r", new_block_ids=None, num_computed_tokens=0, num_scheduled_tokens=len(tokens))
            (job,) = planner.build().stores
            worker = pipeline(client, shard(full_kv(dtype=dtype, seed=3), tp=1, rank=0), nm, tp=1, rank=0)
            worker.store(job)
            worker.wait_uploads(60)
            assert worker.stats.stored_blocks == 5
        events = [e for b in read_batches(gw.url, since=start, events=5) for e in b["events"]]
        by_key = {e["key"]: e for e in events}
        for i, h in enumerate(hs):
            e = by_key[nm.block(h)]
            assert e["token_ids"] == tokens[i * BLOCK : (i + 1) * BLOCK]
            assert e["parent_block_hash"] == (hs[i - 1].hex() if i else None)
    finally:
        gw.stop()
