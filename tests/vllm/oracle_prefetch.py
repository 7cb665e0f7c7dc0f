"""Run in the oracle venv: fetch at arrival with a KVGateConnector built by vLLM's factory (both roles), driven as
vLLM's scheduler and worker drive them, without an engine, against a gateway.

argv: <gateway url> <model dir>; prints one JSON object with what it saw: a stored prompt's request, told to the
connector on arrival (``on_new_request``, as ``Scheduler.add_request`` does) and not admitted yet, gets its blocks
read into the worker's host memory by idle steps; then admitted, its load reads nothing more and its KV bytes are
the stored ones. A second such request is aborted before admission: its prefetched bytes are freed.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from typing import Any

import torch
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

from connector.planning.plan import BlockJob, StepPlan
from connector.vllm.connector import KVGateConnector, KVGateConnectorMetadata
from tests.vllm.oracle_connector import kv_tensors
from tests.vllm.oracle_pd import PROMPT_BLOCKS, config_landed, counts, delta, pair, request

BUDGET_MIB = 16


def gets(url: str, before: Any) -> int:
    """Block GETs the gateway answered since ``before``."""
    return sum(n for k, n in delta(url, before).items() if k.startswith("GET /v1/blocks"))


def step(sched: KVGateConnector, worker: KVGateConnector) -> StepPlan:
    """One engine step with nothing scheduled: the scheduler's metadata to the worker, as vLLM ships it."""
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    assert isinstance(meta, KVGateConnectorMetadata)
    return meta.plan


def until(check: Any, *, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def arrive(sched: KVGateConnector, worker: KVGateConnector, req: Any) -> list[list[Any]]:
    """``add_request``: the connector hears of the request; idle steps until its prefetch is shipped."""
    sched.on_new_request(req)
    shipped: list[list[Any]] = []
    deadline = time.monotonic() + 30
    while not shipped and time.monotonic() < deadline:
        shipped = [[j.req_id, len(j.hashes)] for j in step(sched, worker).prefetches]
    return shipped


def held(worker: KVGateConnector) -> int:
    return int(worker.pipeline.prefetch.held_bytes)


def check(url: str, model_dir: str) -> dict[str, Any]:
    init_none_hash(sha256)
    extra = {"lookup_wait_ms": 200, "prefetch_budget_mib": BUDGET_MIB}
    writer_sched, writer = pair(url, model_dir, "kv_both", {})
    sched, worker = pair(url, model_dir, "kv_both", extra)
    src, dst = kv_tensors(1), kv_tensors(2)
    before = counts(url)
    writer.register_kv_caches(src)
    worker.register_kv_caches(dst)
    config_landed(url, before)
    q = request("q", 0, None)
    hashes = tuple(bytes(h) for h in q.block_hashes)
    ids = tuple(range(PROMPT_BLOCKS))
    writer.bind_connector_metadata(
        KVGateConnectorMetadata(StepPlan(stores=[BlockJob(req_id="w", hashes=hashes, block_ids=(ids,))]))
    )
    writer.wait_for_save()
    writer.clear_connector_metadata()
    writer.pipeline.wait_uploads(60)
    block_bytes = worker.pipeline.prefetch.block_bytes
    out: dict[str, Any] = {
        "hook": "self.connector.on_new_request(request)" in inspect.getsource(Scheduler.add_request),
        "stored": writer.pipeline.stats.stored_blocks,
        "block_bytes": block_bytes,
    }

    # arrival: the request waits (not admitted); its blocks come into host memory meanwhile
    before = counts(url)
    out["shipped"] = arrive(sched, worker, q)
    until(lambda: gets(url, before) >= PROMPT_BLOCKS and held(worker) == PROMPT_BLOCKS * block_bytes)
    out["gets_before_admission"] = gets(url, before)
    out["held_before_admission"] = held(worker)
    stats = worker.get_kv_connector_stats()  # what vLLM logs and exports, before the admission
    out["stats_before_admission"] = stats.reduce() if stats is not None else {}
    # admission: the lookup is answered already (no "ask again"), the load takes the prefetched bytes
    out["matched"] = list(sched.get_num_new_matched_tokens(q, 0))
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=10 + i) for i in range(PROMPT_BLOCKS + 1)],))
    sched.update_state_after_alloc(q, blocks, out["matched"][0] or 0)
    plan = step(sched, worker)
    out["loads"] = [[j.req_id, len(j.hashes)] for j in plan.loads]
    recving: set[str] = set()
    until(lambda: bool(recving.update(worker.get_finished(set())[1] or ()) or "q" in recving))
    out["recving"] = sorted(recving)
    out["errors"] = sorted(worker.get_block_ids_with_load_errors())
    out["gets_after_load"] = gets(url, before)
    out["equal"] = all(
        torch.equal(dst[n][10 + i].view(torch.int16), src[n][i].view(torch.int16))
        for n in src
        for i in range(PROMPT_BLOCKS)
    )
    stats = worker.get_kv_connector_stats()
    out["worker_stats"] = stats.reduce() if stats is not None else {}
    sched.request_finished(q, [])

    # abort before admission: request_finished (vLLM calls it for a waiting request it aborts) drops the bytes
    a = request("a", 0, None)
    out["abort_shipped"] = arrive(sched, worker, a)
    out["abort_held"] = until(lambda: held(worker) == PROMPT_BLOCKS * block_bytes) and held(worker)
    stats = worker.get_kv_connector_stats()
    out["abort_stats_held"] = stats.reduce() if stats is not None else {}
    sched.request_finished(a, [])
    out["drops"] = step(sched, worker).drops
    until(lambda: held(worker) == 0)
    stats = worker.get_kv_connector_stats()
    out["abort_stats"] = stats.reduce() if stats is not None else {}
    sched_stats = sched.get_kv_connector_stats()
    out["sched_stats"] = sched_stats.reduce() if sched_stats is not None else {}
    for c in (sched, worker, writer_sched, writer):
        c.shutdown()
    return out


def main() -> None:
    url, model_dir = sys.argv[1:3]
    print("RESULT " + json.dumps(check(url, model_dir)))


if __name__ == "__main__":
    main()
