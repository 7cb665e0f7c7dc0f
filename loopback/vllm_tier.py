"""A vLLM secondary tier driven on its own, as vLLM's scheduler drives it: the spec vLLM builds tiers from, a
page-aligned primary region, and the steps (submit, poll, lookup) timed on the caller's thread. Runs where vLLM is
installed (the oracle venv): tests/vllm/tier_driver.py's scenarios and benchmarks/connector/tier_throughput.py."""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

ROW_BYTES = 64 * 1024
NUM_CHUNKS = 16
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def make_spec(
    tiers: list[dict[str, Any]],
    *,
    num_chunks: int = NUM_CHUNKS,
    row_bytes: int = ROW_BYTES,
    tp_size: int = 1,
    engine_id: str = "kvgate-test",
    blocks_per_chunk: int = 1,
) -> TieringOffloadingSpec:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.attn",), group_id=0),),
        worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": num_chunks * row_bytes, "secondary_tiers": tiers},
        engine_id=f"{engine_id}-{os.getpid()}-{random.randrange(1 << 30)}",
        model=OffloadingModelConfig(name="test-org/tiny-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return TieringOffloadingSpec(config)


def kvgate_tier_cfg(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "KVGateTier", "module_path": "connector.vllm_tier", "url": url, "enable_kv_events": True, **extra}


def standalone_tier(spec: TieringOffloadingSpec, tier_cfg: dict[str, Any], view: memoryview) -> Any:
    return SecondaryTierFactory.create_secondary_tier(dict(tier_cfg), view, spec)


def primary_view(num_chunks: int = NUM_CHUNKS, row_bytes: int = ROW_BYTES) -> memoryview:
    """Page-aligned like vLLM's shared offload region (its fs tier reads with O_DIRECT where it can)."""
    return memoryview(mmap.mmap(-1, num_chunks * row_bytes)).cast("B", (num_chunks, row_bytes))


def keys_for(n: int, seed: str) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{seed}-{i}".encode()).digest(), 0) for i in range(n)]


def fill(view: memoryview, chunk_ids: Iterable[int], seed: int) -> list[bytes]:
    rows = view.cast("B")
    size = view.strides[0]
    out = []
    rng = random.Random(seed)
    for cid in chunk_ids:
        data = rng.randbytes(size)
        rows[cid * size : (cid + 1) * size] = data
        out.append(data)
    return out


def row(view: memoryview, cid: int) -> bytes:
    size = view.strides[0]
    return bytes(view.cast("B")[cid * size : (cid + 1) * size])


class Steps:
    """Drives a tier as the scheduler would, timing every call made on the scheduler's thread."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.worst_s = 0.0
        self.worst_call = ""
        self.next_job = 1000

    def call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.monotonic()
        out = fn(*args)
        if name in ("get_finished_jobs", "take_events"):
            out = list(out)
        dt = time.monotonic() - t0
        if dt > self.worst_s:
            self.worst_s, self.worst_call = dt, name
        return out

    def job(self, keys: list[bytes], chunk_ids: list[int], *, load: bool, req: str = "r") -> int:
        self.next_job += 1
        job = TransferJob(
            job_id=self.next_job,
            keys=keys,
            chunk_ids=np.array(chunk_ids, dtype=np.int64),
            is_promotion=load,
            req_context=ReqContext(req_id=req),
        )
        self.call(
            "submit_load" if load else "submit_store", self.tier.submit_load if load else self.tier.submit_store, job
        )
        return self.next_job

    def wait(self, job_ids: set[int], timeout_s: float = 20.0) -> dict[int, Any]:
        done: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while set(done) != job_ids and time.monotonic() < deadline:
            for result in self.call("get_finished_jobs", self.tier.get_finished_jobs):
                done[result.job_id] = result
            self.call("on_schedule_end", self.tier.on_schedule_end, END)
            time.sleep(0.005)
        return done

    def lookups(self, keys: list[bytes], req: str, timeout_s: float = 10.0) -> tuple[list[str], float, int]:
        """Look ``keys`` up step after step until none answers RETRY: (verdicts, seconds, steps)."""
        ctx = ReqContext(req_id=req)
        self.call("on_new_request", self.tier.on_new_request, ctx)
        t0 = time.monotonic()
        steps = 0
        while True:
            steps += 1
            verdicts = [self.call("lookup", self.tier.lookup, k, ctx) for k in keys]
            self.call("on_schedule_end", self.tier.on_schedule_end, END)
            if LookupResult.RETRY not in verdicts or time.monotonic() - t0 > timeout_s:
                return [v.name for v in verdicts], time.monotonic() - t0, steps
            time.sleep(0.005)

    def finish(self, req: str) -> None:
        self.call("on_request_finished", self.tier.on_request_finished, ReqContext(req_id=req))
