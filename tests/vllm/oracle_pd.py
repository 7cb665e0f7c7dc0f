"""Run in the oracle venv: a kv_producer and a kv_consumer KVGateConnector (vLLM's factory, both roles each) hand a
request's KV over through a real gateway, driven as vLLM's scheduler and worker drive them, without an engine.

argv: <gateway url> <model dir> <check>; prints one JSON object with what it saw. Checks:
- ``handoff``: P stores a prompt (P/D marked) and returns kv_transfer_params; D, given them, loads the prompt's
  full blocks; the gateway's request counts between the phases say P never looked up or read, D never wrote.
- ``race``: D's lookup is sent before P's stores start: it waits on the gateway and answers the full hit.
- ``absent``: D's params name blocks P never stored: after its wait D answers what is there (a miss).
- ``down``: no gateway listens at the url: D's lookup fails at once, a miss, long before its wait would end.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from typing import Any

import httpx
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from connector.vllm.connector import KVGateConnector
from tests.vllm.oracle_connector import BLOCK, configs, kv_tensors

PROMPT_BLOCKS = 3
PROMPT = 3 * BLOCK + 5


def pair(url: str, model_dir: str, role: str, extra: dict[str, Any]) -> tuple[KVGateConnector, KVGateConnector]:
    vc, kc = configs(url, model_dir)
    vc.kv_transfer_config = KVTransferConfig(
        kv_connector="KVGateConnector",
        kv_connector_module_path="connector.vllm",
        kv_role=role,
        kv_connector_extra_config={"url": url, **extra},
    )
    return (
        KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kc),
        KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kc),
    )


def request(req_id: str, first: int, params: dict[str, Any] | None) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(
        request_id=req_id,
        prompt_token_ids=list(range(first, first + PROMPT)),
        sampling_params=SamplingParams(max_tokens=1, extra_args=extra),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def counts(url: str) -> Counter[str]:
    """The gateway's request counts by "METHOD route" (from /metrics)."""
    out: Counter[str] = Counter()
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvgate_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            out[f"{labels['method']} {labels['route']}"] += int(float(line.split()[-1]))
    return out


def delta(url: str, before: Counter[str]) -> dict[str, int]:
    now = counts(url)
    return {k: now[k] - before[k] for k in now if now[k] != before[k] and "/metrics" not in k}


def config_landed(url: str, before: Counter[str], *, timeout_s: float = 30.0) -> None:
    """Wait until the gateway has answered a namespace config's PUT since ``before``."""
    deadline = time.monotonic() + timeout_s
    while not any(k.startswith("PUT /v1/namespaces") for k in delta(url, before)):
        if time.monotonic() > deadline:
            raise TimeoutError("the producer's namespace config never reached the gateway")
        time.sleep(0.02)


def store(worker: KVGateConnector, meta: Any) -> None:
    """P's worker: the step's stores, to the end of their uploads."""
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    worker.pipeline.wait_uploads(60)


def produce(sched: KVGateConnector, req: Request) -> tuple[dict[str, Any], Any]:
    """P's scheduler: matches, allocates and schedules the whole prompt; the request finishes and returns its
    params. Returns them and the step's metadata (for the worker to store)."""
    matched = sched.get_num_new_matched_tokens(req, 0)
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in range(PROMPT_BLOCKS + 1)],))
    sched.update_state_after_alloc(req, blocks, 0)
    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [NewRequestData.from_request(req, blocks.get_block_ids())]
    step.num_scheduled_tokens = {req.request_id: req.num_tokens}
    step.total_num_scheduled_tokens = req.num_tokens
    meta = sched.build_connector_meta(step)
    delay_free, params = sched.request_finished(req, [])
    stores = meta.plan.stores
    summary = {
        "matched": list(matched),
        "delay_free": delay_free,
        "params": params,
        "keep": [job.keep for job in stores],
        "planned": sum(len(job.hashes) for job in stores),
    }
    return summary, meta


def matched_when_answered(sched: KVGateConnector, req: Request, *, timeout_s: float = 30.0) -> list[Any]:
    """As vLLM's scheduler asks: again each step (an idle step waits, bounded, for the lookup) until answered."""
    deadline = time.monotonic() + timeout_s
    got = sched.get_num_new_matched_tokens(req, 0)
    while got[0] is None and time.monotonic() < deadline:
        sched.build_connector_meta(SchedulerOutput.make_empty())
        got = sched.get_num_new_matched_tokens(req, 0)
    return list(got)


def consume(sched: KVGateConnector, worker: KVGateConnector, req: Request, n: int) -> dict[str, Any]:
    """D: allocate the hit, ship the step's plan, load on the worker until it reports the request."""
    hit = n // BLOCK
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=10 + i) for i in range(hit + 1)],))
    sched.update_state_after_alloc(req, blocks, n)
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    recving: set[str] = set()
    deadline = time.monotonic() + 60
    while req.request_id not in recving and time.monotonic() < deadline:
        _, got = worker.get_finished(set())
        recving |= got or set()
        time.sleep(0.01)
    worker.clear_connector_metadata()
    return {"loads": [len(j.hashes) for j in meta.plan.loads], "recving": sorted(recving)}


def check(url: str, model_dir: str, which: str) -> dict[str, Any]:
    init_none_hash(sha256)
    if which == "down":
        return down(url, model_dir)
    p_sched, p_worker = pair(url, model_dir, "kv_producer", {})
    d_sched, d_worker = pair(url, model_dir, "kv_consumer", {"handoff_wait_ms": 5000, "lookup_wait_ms": 200})
    src, dst = kv_tensors(1), kv_tensors(2)
    before = counts(url)
    p_worker.register_kv_caches(src)
    config_landed(url, before)  # P's config write goes in the background: not to be counted as D's
    before = counts(url)
    d_worker.register_kv_caches(dst)
    out: dict[str, Any] = {"d_register": delta(url, before)}
    first = {"handoff": 0, "race": 1000, "absent": 2000}[which]
    if which == "handoff":
        before = counts(url)
        out["p"], meta = produce(p_sched, request("p", first, {"do_remote_decode": True}))
        store(p_worker, meta)
        out["p"]["stored"] = p_worker.pipeline.stats.stored_blocks
        out["p_requests"] = delta(url, before)
        before = counts(url)
        d_req = request("d", first, out["p"]["params"])
        out["d_matched"] = matched_when_answered(d_sched, d_req)
        out["d"] = consume(d_sched, d_worker, d_req, out["d_matched"][0] or 0)
        out["d_requests"] = delta(url, before)
        out["equal"] = all(
            torch.equal(dst[n][10 + i].view(torch.int16), src[n][i].view(torch.int16))
            for n in src
            for i in range(PROMPT_BLOCKS)
        )
    elif which == "race":
        p_req = request("p", first, None)  # a kv_producer hands every request off, marked or not
        p, meta = produce(p_sched, p_req)
        d_req = request("d", first, p["params"])
        sent = time.monotonic()
        out["d_first"] = list(d_sched.get_num_new_matched_tokens(d_req, 0))  # the lookup waits on the gateway
        time.sleep(0.5)
        d_sched.build_connector_meta(SchedulerOutput.make_empty())
        out["d_still_waiting"] = list(d_sched.get_num_new_matched_tokens(d_req, 0))
        store(p_worker, meta)  # P's worker runs its step's stores only now
        out["d_matched"] = matched_when_answered(d_sched, d_req)
        out["d_waited_s"] = time.monotonic() - sent
        out["p"] = {k: p[k] for k in ("planned", "keep")}
    else:
        p_req = request("p", first, None)
        p, _ = produce(p_sched, p_req)  # P's stores never happen
        d_req = request("d", first, p["params"])
        sent = time.monotonic()
        out["d_matched"] = matched_when_answered(d_sched, d_req)
        out["d_waited_s"] = time.monotonic() - sent
        out["abandoned_lookups"] = d_sched.planner.stats.abandoned_lookups
    for c in (p_sched, p_worker, d_sched, d_worker):
        c.shutdown()
    return out


def down(url: str, model_dir: str) -> dict[str, Any]:
    p_sched, _ = pair(url, model_dir, "kv_producer", {})
    d_sched, _ = pair(url, model_dir, "kv_consumer", {"handoff_wait_ms": 5000, "lookup_wait_ms": 200})
    p, _ = produce(p_sched, request("p", 3000, None))
    d_req = request("d", 3000, p["params"])
    sent = time.monotonic()
    out = {"d_matched": matched_when_answered(d_sched, d_req), "d_waited_s": time.monotonic() - sent}
    for c in (p_sched, d_sched):
        c.shutdown()
    return out


def main() -> None:
    url, model_dir, which = sys.argv[1:4]
    print("RESULT " + json.dumps(check(url, model_dir, which)))


if __name__ == "__main__":
    main()
