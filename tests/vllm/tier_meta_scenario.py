"""The tier's chunk meta against vLLM's own (run by tests/vllm/tier_driver.py in the oracle venv, real vLLM 0.33.0).

A real vLLM ``Request`` (vLLM's block hasher) is told to the tiers through ``KVGateOffloadingConnector.on_new_request``
and vLLM's own TieringOffloadingManager; its chunks are stored through the kvgate tier as the scheduler would store
them (their end positions recorded in the ReqContext as vLLM's RequestOffloadState does). vLLM's own
self-describing events for the same chunks (OffloadingEventsTracker, as OffloadingConnector publishes them) are
reported for the test to compare with the gateway's. A second request, not announced (vLLM's plain
OffloadingConnector), stores chunks without meta.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as offloading_scheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import (
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.request import Request

from connector.vllm.offloading import KVGateOffloadingConnector
from loopback.vllm_tier import Steps, fill, kvgate_tier_cfg, make_spec

TOKENS_PER_HASH = 16


def meta(args: argparse.Namespace) -> dict[str, Any]:
    bpc = int(vars(args).get("blocks_per_chunk") or 1)
    spec = make_spec([kvgate_tier_cfg(args.url)], blocks_per_chunk=bpc)
    manager = spec.get_manager()
    tier = manager.secondary_tiers[0]
    steps = Steps(tier)
    init_none_hash(sha256)
    tokens_per_chunk, hashes_per_chunk = TOKENS_PER_HASH * bpc, bpc
    contexts = []

    def told(request: Request) -> None:  # what OffloadingConnectorScheduler.on_new_request does with the tiers
        ctx = offloading_scheduler._create_req_context(request)
        contexts.append(ctx)
        manager.on_new_request(ctx)

    connector = KVGateOffloadingConnector.__new__(KVGateOffloadingConnector)
    connector.connector_scheduler = SimpleNamespace(on_new_request=told)
    report: dict[str, Any] = {"requests": []}
    chunk = 0
    for n, (prompt, announce) in enumerate(((list(range(7, 7 + 4 * tokens_per_chunk + 5)), True), ([3] * 40, False))):
        request = Request(
            f"meta-{n}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=get_request_block_hasher(TOKENS_PER_HASH, sha256),
        )
        if announce:
            connector.on_new_request(request)  # KVGateOffloadingConnector
        else:
            told(request)  # vLLM's OffloadingConnector: the tier is not told the request
        ctx = contexts[-1]
        keys = []
        for i in range(len(request.block_hashes) // hashes_per_chunk):  # RequestOffloadState.update_offload_keys
            key = make_offload_key(request.block_hashes[(i + 1) * hashes_per_chunk - 1], 0)
            ctx.set_offload_key_position(key, (i + 1) * tokens_per_chunk)
            keys.append(key)
        chunk_ids = list(range(chunk, chunk + len(keys)))
        chunk += len(keys)
        fill(tier._primary_kv_view, chunk_ids, seed=n)
        steps.next_job += 1
        job = TransferJob(
            job_id=steps.next_job,
            keys=keys,
            chunk_ids=np.array(chunk_ids, dtype=np.int64),
            is_promotion=False,
            req_context=ctx,
        )
        tier.submit_store(job)
        done = steps.wait({steps.next_job})
        # vLLM's own self-describing events of these chunks, as its OffloadingConnector publishes them
        tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, True))
        group = offloading_scheduler.GroupOffloadConfig(
            group_idx=0,
            tokens_per_block=TOKENS_PER_HASH,
            tokens_per_chunk=tokens_per_chunk,
            hashes_per_chunk=hashes_per_chunk,
            kv_event_group_spec=OffloadingEventGroupSpec(None, None),
            sliding_window_size_in_chunks=None,
            kv_cache_spec=None,
            manager_cls=None,
        )
        for i, key in enumerate(keys):
            tracker.record_store(request, group, i, key)
        stored = OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=False, locality=None, ownership=None)
        report["requests"].append(
            {
                "announced": announce,
                "success": [r.success for r in done.values()],
                "paths": [tier.key_path(k) for k in keys],
                "vllm_events": [msgspec.to_builtins(e) for e in tracker.take_events([stored])],
            }
        )
    manager.shutdown()
    return report
