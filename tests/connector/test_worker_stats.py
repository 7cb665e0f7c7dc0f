"""A worker rank's report (``WorkerPipeline.report``, what the worker-role ``KVGateConnector.get_kv_connector_stats``
sends vLLM each step): the increments of its counts since the last report, the host bytes it holds now, and
nothing when nothing happened. No gateway: the client points at a port nobody listens on, so every PUT and GET
fails, and the budget and the buffers are filled by hand, so each reason for a drop is made on purpose."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from connector.device.transfer import BlockTransfer, KVLayout
from connector.http.client import BlockClient, ClientConfig
from connector.planning.plan import PlanStats
from connector.worker.pipeline import WORKER_COUNTERS, WORKER_GAUGES, WorkerPipeline
from tests.connector.test_pipeline import full_kv, hashes, job, load, run_naming, shard
from tests.gateway import free_port

DTYPE = torch.bfloat16


@pytest.fixture
def dead() -> Iterator[BlockClient]:
    cfg = ClientConfig(base_url=f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01, down_cooldown_s=30)
    with BlockClient(cfg) as c:
        yield c


def one_buffer(client: BlockClient) -> tuple[WorkerPipeline, BlockTransfer]:
    kv = shard(full_kv(dtype=DTYPE, seed=90), tp=1, rank=0)
    transfer = BlockTransfer(kv_caches=kv, layout=KVLayout.NHD, max_blocks_per_batch=2, store_buffers=1, load_buffers=2)
    p = WorkerPipeline(
        client=client, naming=run_naming(tp=1, rank=0, dtype=DTYPE), transfers=[transfer], tp_size=1, tp_rank=0
    )
    return p, transfer


def test_the_workers_keys_are_not_the_schedulers() -> None:
    assert not (set(WORKER_COUNTERS) | set(WORKER_GAUGES)) & (set(PlanStats.COUNTERS) | {"bandwidth_mib_s"})
    assert not set(WORKER_COUNTERS) & set(WORKER_GAUGES)


def test_each_report_holds_what_happened_since_the_last(dead: BlockClient) -> None:
    p, transfer = one_buffer(dead)
    capacity = transfer.store_pool.buffer_bytes
    assert p.report() == {}  # nothing happened, nothing held

    # the only store buffer is in use: both batches of a 4-block store find none, and the buffer's bytes are held
    held = transfer.store_pool.try_acquire()
    assert held is not None
    p.store(job("a", hashes(90, 4), [0, 1, 2, 3]))
    assert p.report() == {"store_drops_buffer": 4, "dropped_store_requests": 1, "store_bytes_held": capacity}

    # the buffer back: a 2-block store is gathered and its PUTs fail (the gateway is down); nothing held after it
    held.release()
    p.store(job("b", hashes(91, 2), [4, 5]))
    p.wait_uploads(60)
    assert p.report() == {"store_drops_failed": 2, "store_bytes_held": 0}
    assert p.report() == {}  # nothing since

    # no room in the client's budget of bytes in flight; and a load of 3 blocks that the gateway cannot serve
    dead.budget.limit = 1
    p.store(job("c", hashes(92, 2), [6, 7]))
    assert load(p, job("r", hashes(91, 3), [8, 9, 10])) == {8, 9, 10}
    assert p.report() == {"store_drops_budget": 2, "dropped_store_requests": 1, "load_failed_blocks": 3}
    assert p.report() == {}
    # the counts themselves go on: the report is their increments, never a reset
    assert p.stats.dropped_blocks == 6 and p.stats.dropped_requests == 2 and p.stats.failed_blocks == 2
