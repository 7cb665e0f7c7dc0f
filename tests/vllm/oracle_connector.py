"""Run in the oracle venv: build KVGateConnector through vLLM's own factory in both roles, against a gateway.

argv: <gateway url> <model dir> <check>; prints one JSON object with what it saw.
"""

from __future__ import annotations

import inspect
import json
import sys
import time

import torch
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from connector.planning.plan import BlockJob, StepPlan
from connector.vllm.connector import KVGateConnector, KVGateConnectorMetadata

LAYERS, HEADS, HEAD, BLOCK, NUM_BLOCKS = 4, 8, 32, 16, 24


def configs(url: str, model_dir: str) -> tuple[VllmConfig, KVCacheConfig]:
    kt = KVTransferConfig(
        kv_connector="KVGateConnector",
        kv_connector_module_path="connector.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"url": url, "lookup_wait_ms": 5000},
    )
    vc = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=BLOCK),
        parallel_config=ParallelConfig(tensor_parallel_size=1),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kt,
        # the layout vLLM declares for a GPU run (this venv has no platform to pick one): a certified one
        attention_config=AttentionConfig(backend=AttentionBackendEnum.FLASH_ATTN),
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    kc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    return vc, kc


def check_subclass() -> dict[str, object]:
    params = list(inspect.signature(KVGateConnector.__init__).parameters)
    return {
        "subclass": issubclass(KVGateConnector, KVConnectorBase_V1),
        "hma": issubclass(KVGateConnector, SupportsHMA),
        "abstract": sorted(getattr(KVGateConnector, "__abstractmethods__", ())),
        "init_params": params,
        "base_init_params": list(inspect.signature(KVConnectorBase_V1.__init__).parameters),
    }


def kv_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randint(
            -(2**15),
            2**15,
            (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD),
            generator=g,  # vLLM's logical [block, head, token, K|V] view
        )
        .to(torch.int16)
        .view(torch.bfloat16)
        for i in range(LAYERS)
    }


def matched(sched: KVGateConnector, request: Request) -> tuple[int | None, bool]:
    """As vLLM's scheduler asks: "ask again" (None) while the lookup is in flight; a step with nothing scheduled
    waits for it (build_connector_meta), and the next one reads the answer."""
    got = sched.get_num_new_matched_tokens(request, 0)
    if got[0] is None:
        sched.build_connector_meta(SchedulerOutput.make_empty())
        got = sched.get_num_new_matched_tokens(request, 0)
    return got


def check_roles(url: str, model_dir: str) -> dict[str, object]:
    vc, kc = configs(url, model_dir)
    sched = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kc)
    writer = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kc)
    reader = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kc)
    src, dst = kv_tensors(1), kv_tensors(2)
    writer.register_kv_caches(src)
    reader.register_kv_caches(dst)
    init_none_hash(sha256)
    request = Request(
        request_id="q",
        prompt_token_ids=list(range(3 * BLOCK + 5)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    hashes = tuple(bytes(h) for h in request.block_hashes)
    before = matched(sched, request)
    writer.bind_connector_metadata(
        KVGateConnectorMetadata(StepPlan(stores=[BlockJob(req_id="w", hashes=hashes, block_ids=((0, 1, 2),))]))
    )
    writer.wait_for_save()
    writer.clear_connector_metadata()
    # a preemption travels from the scheduler's SchedulerOutput through the metadata to handle_preemptions
    step = SchedulerOutput.make_empty()
    step.preempted_req_ids = {"w"}
    preempt_meta = sched.build_connector_meta(step)
    writer.handle_preemptions(preempt_meta)
    writer.pipeline.wait_uploads(60)
    sending, _ = writer.get_finished({"w"})
    # the scheduler's one lookup sees the stored prefix
    keys = sched.planner.keys.keys(list(hashes))
    prefix, _ = sched.client.run(sched.client.lookup(keys))
    sched.request_finished(request, [])
    after = matched(sched, request)
    reader.bind_connector_metadata(
        KVGateConnectorMetadata(StepPlan(loads=[BlockJob(req_id="r", hashes=hashes, block_ids=((5, 6, 7),))]))
    )
    reader.start_load_kv(None)
    reader.clear_connector_metadata()
    recving: set[str] = set()
    deadline = time.monotonic() + 60
    while not recving and time.monotonic() < deadline:
        _, got = reader.get_finished(set())
        recving |= got or set()
        time.sleep(0.01)
    errors = reader.get_block_ids_with_load_errors()
    # what the load measured reaches the scheduler's cost model through vLLM's worker metadata
    worker_meta = reader.build_connector_worker_meta()
    sched.update_connector_output(KVConnectorOutput(finished_recving={"r"}, kv_connector_worker_meta=worker_meta))
    # and the decisions reach vLLM's periodic stats log (the scheduler's stats, rebuilt as the logger does)
    stats = sched.get_kv_connector_stats()
    logged = type(sched).build_kv_connector_stats(stats.to_dict()).reduce() if stats is not None else {}
    equal = all(
        torch.equal(dst[n][5 + i].view(torch.int16), src[n][i].view(torch.int16)) for n in src for i in range(3)
    )
    out = {
        "sched_role": sched.role.name,
        "worker_role": writer.role.name,
        "namespace": sched.naming.namespace,
        "agnostic": sched.naming.parallel_agnostic,
        "sending": sorted(sending or ()),
        "prefix": prefix,
        "hash_len": len(hashes[0]),
        "matched_before": list(before),
        "matched_after": list(after),
        "recving": sorted(recving),
        "errors": sorted(errors),
        "equal": equal,
        "stored": writer.pipeline.stats.stored_blocks,
        "preempted": list(preempt_meta.plan.preempted),
        "worker_meta": type(worker_meta).__name__,
        "logged": logged,
        "stats_again": sched.get_kv_connector_stats() is None,
        "measured_load_s": sched.planner.stats.actual_load_s,
        "decisions": [sched.planner.stats.loads, sched.planner.stats.skipped, sched.planner.stats.abandoned],
    }
    for c in (sched, writer, reader):
        c.shutdown()
    return out


def main() -> None:
    url, model_dir, check = sys.argv[1:4]
    result = check_subclass() if check == "subclass" else check_roles(url, model_dir)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
