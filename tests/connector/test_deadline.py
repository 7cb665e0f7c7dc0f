"""Never slower than recompute: every load has a deadline, and the cost model loads only what pays.

A real gateway behind a test-only TCP proxy (loopback/proxy.py) that throttles its answers or stops passing them
half-way. The worker pipeline loads into CPU KV tensors; the scheduler's planner asks the gateway for real.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from connector.device.transfer import BlockTransfer, KVLayout
from connector.http.client import BlockClient, ClientConfig
from connector.planning.cost import MIB, CostModel, CostSettings
from connector.planning.plan import BlockJob, KeyScheme, SchedulerPlanner
from connector.worker.pipeline import WorkerPipeline
from loopback.proxy import proxy
from tests.connector.test_pipeline import BLOCK, LAYER_NAMES, full_kv, hashes, run_naming, same, shard
from tests.gateway import Gateway

DTYPE = torch.bfloat16
TRANSFER_TIMEOUT_S = 30.0
N = 12


def one_block_windows(client: BlockClient, kv: dict[str, torch.Tensor]) -> WorkerPipeline:
    """A pipeline that reads one block at a time: the blocks arrive in order, one after the other."""
    transfer = BlockTransfer(kv_caches=kv, layout=KVLayout.NHD, max_blocks_per_batch=1, store_buffers=N, load_buffers=2)
    return WorkerPipeline(
        client=client, naming=run_naming(tp=1, rank=0, dtype=DTYPE), transfers=[transfer], tp_size=1, tp_rank=0
    )


@pytest.fixture
def stored(gateway: Gateway) -> Iterator[tuple[dict[str, torch.Tensor], tuple[bytes, ...], int]]:
    """N blocks stored through the gateway directly: (the writer's KV, their hashes, one block's bytes)."""
    src = shard(full_kv(dtype=DTYPE, seed=60), tp=1, rank=0)
    hs = hashes(60, N)
    with BlockClient(ClientConfig(base_url=gateway.url)) as c:
        writer = one_block_windows(c, src)
        writer.store(BlockJob(req_id="w", hashes=hs, block_ids=(tuple(range(N)),)))
        writer.wait_uploads(60)
        assert writer.stats.stored_blocks == N
        yield src, hs, writer.transfers[0].block_bytes()


def reader_client(url: str) -> BlockClient:
    return BlockClient(ClientConfig(base_url=url, request_timeout_s=TRANSFER_TIMEOUT_S))


def check_partial(
    src: dict[str, torch.Tensor],
    dest: dict[str, torch.Tensor],
    before: dict[str, torch.Tensor],
    ids: list[int],
    failed: set[int],
) -> int:
    """The blocks loaded are a prefix, byte-equal to the stored ones; exactly the others are reported, untouched."""
    loaded = N - len(failed)
    assert failed == set(ids[loaded:])
    for name in LAYER_NAMES:
        for s, d in enumerate(ids):
            expected = src[name][:, s] if s < loaded else before[name][:, d]
            assert same(dest[name][:, d], expected), (name, s, d)
    return loaded


def test_a_throttled_link_gives_up_at_the_deadline_and_reports_what_did_not_arrive(
    gateway: Gateway, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...], int]
) -> None:
    src, hs, block_bytes = stored
    rate = 4 * block_bytes  # 4 blocks a second: the whole load takes 3 s
    dest = shard(full_kv(dtype=DTYPE, seed=61), tp=1, rank=0)
    before = {k: v.clone() for k, v in dest.items()}
    ids = list(range(20, 20 + N))
    with proxy(upstream_port=gateway.port, rate_bytes_s=rate) as link, reader_client(link.url) as c:
        reader = one_block_windows(c, dest)
        started = time.monotonic()
        failed = reader.load(BlockJob(req_id="r", hashes=hs, block_ids=(tuple(ids),), deadline_s=1.0)).result(60)
        elapsed = time.monotonic() - started
    loaded = check_partial(src, dest, before, ids, failed)
    assert 0 < loaded < N, loaded  # some arrived before the deadline, not all
    assert elapsed < N / 4  # it did not wait for the rest (3 s at this rate)
    outcome = reader.take_outcomes()["r"]
    assert outcome.expired and outcome.loaded == loaded and outcome.nbytes >= loaded * block_bytes
    assert reader.stats.expired_loads == 1 and reader.stats.load_errors == N - loaded
    assert reader.transfers[0].load_pool.available == reader.transfers[0].load_pool.size


def test_a_stalled_gateway_costs_the_deadline_not_the_transfer_timeout(
    gateway: Gateway, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...], int]
) -> None:
    src, hs, block_bytes = stored
    dest = shard(full_kv(dtype=DTYPE, seed=62), tp=1, rank=0)
    before = {k: v.clone() for k, v in dest.items()}
    ids = list(range(30, 30 + N))
    # two blocks and a half pass (with their headers), then the gateway says nothing more
    with proxy(upstream_port=gateway.port, pass_bytes=block_bytes * 5 // 2) as link, reader_client(link.url) as c:
        reader = one_block_windows(c, dest)
        started = time.monotonic()
        job = BlockJob(req_id="r", hashes=hs, block_ids=(tuple(ids),), deadline_s=1.0)
        failed = reader.load(job).result(TRANSFER_TIMEOUT_S * 4)
        elapsed = time.monotonic() - started
        assert link.passed == block_bytes * 5 // 2
    assert elapsed < TRANSFER_TIMEOUT_S / 3, elapsed  # the deadline, not the transfer timeout (with retries)
    assert check_partial(src, dest, before, ids, failed) == 2
    assert reader.take_outcomes()["r"].expired


def planner(client: BlockClient, block_bytes: int, lookup_deadline_s: float = 5.0, **cost: float) -> SchedulerPlanner:
    settings = {"prefill_tokens_s": 16 * 100.0, "lookup_rtt_prior_s": 0.0} | cost  # a block recomputes in 10 ms
    return SchedulerPlanner(
        client=client,
        keys=KeyScheme(namings=[run_naming(tp=1, rank=0, dtype=DTYPE)], num_groups=1),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        cost=CostModel(CostSettings(**settings)),  # type: ignore[arg-type]
        block_bytes=block_bytes,
        lookup_deadline_s=lookup_deadline_s,
    )


def matched(p: SchedulerPlanner, req_id: str, hs: tuple[bytes, ...]) -> int:
    """The planner's answer for a request of the N stored blocks and one more token, once its lookup is in."""
    for _ in range(1000):
        n = p.matched_tokens(req_id=req_id, block_hashes=hs, num_tokens=N * BLOCK + 1, num_computed_tokens=0)
        if n is not None:
            return n
        p.wait_for_lookups(timeout_s=0.05)
    raise AssertionError("no lookup answer")


def test_the_cost_model_skips_a_load_that_would_not_pay_after_measuring_a_slow_link(
    gateway: Gateway, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...], int]
) -> None:
    _src, hs, block_bytes = stored
    rate = 4 * block_bytes  # a block loads in 250 ms and recomputes in 10 ms
    with proxy(upstream_port=gateway.port, rate_bytes_s=rate) as link, reader_client(link.url) as c:
        p = planner(c, block_bytes)
        assert matched(p, "before", hs) == N * BLOCK  # the prior (1000 MiB/s): the whole hit loads
        assert p.stats.loads == 1
        p.after_alloc(req_id="before", block_ids=[list(range(20, 20 + N))], num_external_tokens=N * BLOCK)
        (job,) = p.build().loads
        assert job.deadline_s is not None and job.deadline_s < 1.0  # from the prediction, not the transfer timeout
        reader = one_block_windows(c, shard(full_kv(dtype=DTYPE, seed=63), tp=1, rank=0))
        reader.load(job).result(60)
        (outcome,) = reader.take_outcomes().values()
        assert outcome.expired  # the link is slower than predicted
        p.loaded(req_id="before", outcome=outcome)  # the workers' report reaches the scheduler
        assert p.cost is not None and p.cost.bandwidth(now=time.monotonic()) < 16 * MIB
        assert matched(p, "after", hs) == 0  # recomputing pays now: nothing is loaded
    assert (p.stats.loads, p.stats.skipped, p.stats.abandoned) == (1, 1, 1)
    assert "recomputes" in p.stats.last_reason


def test_the_cost_model_loads_the_part_of_a_prefix_that_fits(
    gateway: Gateway, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...], int]
) -> None:
    _src, hs, block_bytes = stored
    with reader_client(gateway.url) as c:
        # measured: 2 blocks a second (a block loads in 0.5 s); recompute: 1 s a block; the longest wait 2 s
        p = planner(c, block_bytes, prefill_tokens_s=BLOCK * 1.0, max_deadline_s=2.0)
        p.loaded(req_id="earlier", outcome=_outcome(nbytes=2 * block_bytes, seconds=1.0))
        assert matched(p, "r", hs) == 3 * BLOCK  # 3 blocks fit 2 s (with the lookup's round trip), of 12
        assert p.stats.partial == 1 and "3 of 12" in p.stats.last_reason
        p.after_alloc(req_id="r", block_ids=[list(range(N))], num_external_tokens=3 * BLOCK)
        (job,) = p.build().loads
        assert len(job.hashes) == 3 and job.hashes == hs[:3] and job.deadline_s == 2.0


def _outcome(*, nbytes: int, seconds: float):  # type: ignore[no-untyped-def]
    from connector.planning.cost import LoadOutcome

    return LoadOutcome(loaded=0, nbytes=nbytes, seconds=seconds, expired=False)


def test_a_slow_lookup_is_a_miss_not_a_wait(
    gateway: Gateway, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...], int]
) -> None:
    """The gateway holds every answer: the request is a miss at the lookup deadline, not after the client's lookup
    timeout and its retries (2 s, 4 attempts)."""
    _src, hs, block_bytes = stored
    with proxy(upstream_port=gateway.port, pass_bytes=0) as link, reader_client(link.url) as c:
        p = planner(c, block_bytes, lookup_deadline_s=0.3)
        started = time.monotonic()
        assert matched(p, "r", hs) == 0
        elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 2.0, elapsed
    assert p.stats.abandoned_lookups == 1 and p.stats.loads == 0
