"""Fetch at arrival: a request's blocks are read into host memory before the scheduler admits it, and its load then
takes them from there. A real gateway; the worker loads into CPU KV tensors; the gateway's own read counter
(``/v1/stats`` ``hits``) says when the GETs happened."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch

from connector.device.transfer import BlockTransfer, KVLayout
from connector.http.client import BlockClient, ClientConfig
from connector.planning.cost import CostModel, CostSettings
from connector.planning.plan import BlockJob, KeyScheme, SchedulerPlanner
from connector.worker.pipeline import WorkerPipeline
from tests.connector.test_pipeline import BLOCK, LAYER_NAMES, full_kv, hashes, rot, run_naming, same, shard
from tests.gateway import Gateway

DTYPE = torch.bfloat16
N = 6


def reader(client: BlockClient, kv: dict[str, torch.Tensor], *, budget_blocks: int) -> WorkerPipeline:
    transfer = BlockTransfer(kv_caches=kv, layout=KVLayout.NHD, max_blocks_per_batch=4, store_buffers=4, load_buffers=2)
    return WorkerPipeline(
        client=client,
        naming=run_naming(tp=1, rank=0, dtype=DTYPE),
        transfers=[transfer],
        tp_size=1,
        tp_rank=0,
        prefetch_budget_bytes=budget_blocks * transfer.block_bytes(),
    )


def reads(gateway: Gateway) -> int:
    """Block reads the gateway served (GETs that found their block)."""
    return int(httpx.get(f"{gateway.url}/v1/stats").json()["hits"])


def until(check: Callable[[], bool], *, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def client(gateway: Gateway) -> Iterator[BlockClient]:
    with BlockClient(ClientConfig(base_url=gateway.url)) as c:
        yield c


@pytest.fixture
def stored(gateway: Gateway, client: BlockClient) -> tuple[dict[str, torch.Tensor], tuple[bytes, ...]]:
    """N blocks stored through the gateway: (the writer's KV, their hashes)."""
    src = shard(full_kv(dtype=DTYPE, seed=70), tp=1, rank=0)
    hs = hashes(70, N)
    writer = reader(client, src, budget_blocks=0)
    writer.store(BlockJob(req_id="w", hashes=hs, block_ids=(tuple(range(N)),)))
    writer.wait_uploads(60)
    assert writer.stats.stored_blocks == N
    return src, hs


def prefetch(p: WorkerPipeline, req_id: str, hs: tuple[bytes, ...]) -> None:
    p.start_prefetches([BlockJob(req_id=req_id, hashes=hs, block_ids=())])


def test_prefetched_blocks_are_read_before_the_load_and_the_load_reads_none(
    gateway: Gateway, client: BlockClient, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...]]
) -> None:
    src, hs = stored
    dest = shard(full_kv(dtype=DTYPE, seed=71), tp=1, rank=0)
    r = reader(client, dest, budget_blocks=2 * N)
    block_bytes = r.transfers[0].block_bytes()
    base = reads(gateway)
    prefetch(r, "q", hs)
    until(lambda: reads(gateway) == base + N)  # every GET done before any load was asked for
    until(lambda: r.prefetch.ready(BlockJob(req_id="q", hashes=hs, block_ids=())))
    first = r.report()
    assert first["prefetch_bytes_held"] == N * block_bytes and first["prefetch_started"] == 1
    assert first["prefetch_blocks"] == N and "loaded_blocks" not in first
    ids = list(range(30, 30 + N))
    assert r.load(BlockJob(req_id="q", hashes=hs, block_ids=(tuple(ids),))).result(60) == set()
    assert reads(gateway) == base + N  # the load read nothing from the gateway
    for name in LAYER_NAMES:
        for s, d in enumerate(ids):
            assert same(dest[name][:, d], src[name][:, s]), (name, s)
    outcome = r.take_outcomes()["q"]
    assert outcome.loaded == N and outcome.nbytes == 0  # no network bytes for the bandwidth estimate
    report = r.report()
    assert report["prefetch_hits"] == 1 and report["prefetch_used"] == 1 and report["loaded_blocks"] == N
    assert report["prefetch_bytes_held"] == 0 and r.prefetch.held_bytes == 0


def test_a_prefix_that_fits_the_budget_is_prefetched_the_rest_is_read_by_the_load(
    gateway: Gateway, client: BlockClient, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...]]
) -> None:
    src, hs = stored
    dest = shard(full_kv(dtype=DTYPE, seed=72), tp=1, rank=0)
    r = reader(client, dest, budget_blocks=2)
    base = reads(gateway)
    prefetch(r, "q", hs)
    until(lambda: reads(gateway) == base + 2)
    assert r.prefetch.held_bytes == 2 * r.transfers[0].block_bytes()
    prefetch(r, "other", hs)  # the budget is full: nothing more
    until(lambda: r.prefetch.stats.overflows == 2)
    assert r.report()["prefetch_overflows"] == 2 and r.prefetch.stats.started == 1
    ids = list(range(10, 10 + N))
    assert r.load(BlockJob(req_id="q", hashes=hs, block_ids=(tuple(ids),))).result(60) == set()
    assert reads(gateway) == base + N  # the load read the N - 2 blocks that did not fit, and only those
    for name in LAYER_NAMES:
        for s, d in enumerate(ids):
            assert same(dest[name][:, d], src[name][:, s]), (name, s)
    report = r.report()
    assert report["prefetch_used"] == 1 and "prefetch_hits" not in report  # not all of it was in host memory
    assert r.prefetch.held_bytes == 0


def test_a_dropped_prefetch_frees_its_bytes(
    gateway: Gateway, client: BlockClient, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...]]
) -> None:
    _src, hs = stored
    r = reader(client, shard(full_kv(dtype=DTYPE, seed=73), tp=1, rank=0), budget_blocks=N)
    base = reads(gateway)
    prefetch(r, "q", hs)
    until(lambda: reads(gateway) == base + N)
    assert r.report()["prefetch_bytes_held"] == N * r.transfers[0].block_bytes()
    r.start_prefetches([], drops=["q"])
    until(lambda: r.prefetch.held_bytes == 0)
    report = r.report()
    assert report["prefetch_dropped"] == 1 and report["prefetch_bytes_held"] == 0 and "prefetch_used" not in report
    prefetch(r, "again", hs)  # the budget is back
    until(lambda: r.prefetch.stats.blocks == 2 * N)
    assert r.prefetch.stats.overflows == 0


def test_a_corrupt_prefetched_block_is_never_loaded(
    gateway: Gateway, client: BlockClient, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...]]
) -> None:
    src, hs = stored
    nm = run_naming(tp=1, rank=0, dtype=DTYPE)
    rot(gateway.data_dir / "blocks" / nm.block(hs[3]), at_fraction=0.5, mask=0x5A)
    dest = shard(full_kv(dtype=DTYPE, seed=74), tp=1, rank=0)
    before = {k: v.clone() for k, v in dest.items()}
    r = reader(client, dest, budget_blocks=N)
    prefetch(r, "q", hs)
    until(lambda: client.stats.corrupt_reads == 1)  # the prefetch's read of it was refused by its checksum
    ids = list(range(20, 20 + N))
    assert r.load(BlockJob(req_id="q", hashes=hs, block_ids=(tuple(ids),))).result(60) == set(ids[3:])
    for name in LAYER_NAMES:
        for s, d in enumerate(ids):
            assert same(dest[name][:, d], src[name][:, s] if s < 3 else before[name][:, d]), (name, s)
    assert r.prefetch.held_bytes == 0


def planner(client: BlockClient) -> SchedulerPlanner:
    return SchedulerPlanner(
        client=client,
        keys=KeyScheme(namings=[run_naming(tp=1, rank=0, dtype=DTYPE)], num_groups=1),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        cost=CostModel(CostSettings(lookup_rtt_prior_s=0.0)),
        block_bytes=1,
        lookup_deadline_s=5.0,
        prefetch_enabled=True,
    )


def prefetched(p: SchedulerPlanner, want: int) -> list[BlockJob]:
    """The prefetches of the steps built until ``want`` of them were sent (each once the arrival lookup answered)."""
    got: list[BlockJob] = []
    deadline = time.monotonic() + 30
    while len(got) < want:
        assert time.monotonic() < deadline, got
        p.wait_for_lookups(timeout_s=0.1)
        got += p.build().prefetches
    return got


def test_the_planner_prefetches_at_arrival_and_the_admission_finds_the_lookup_answered(
    client: BlockClient, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...]]
) -> None:
    _src, hs = stored
    p = planner(client)
    tokens = (N + 1) * BLOCK  # the N stored blocks are a hit (the last token is computed)
    p.arrived(req_id="q", block_hashes=hs, num_tokens=tokens, token_ids=())
    assert [(j.req_id, j.hashes, j.block_ids) for j in prefetched(p, 1)] == [("q", hs, ())]
    assert p.stats.prefetches == 1
    assert p.stats.loads == 0  # decided, counted when the scheduler takes the decision
    assert p.build().prefetches == []  # sent once
    got = p.matched_tokens(req_id="q", block_hashes=hs, num_tokens=tokens, num_computed_tokens=0)
    assert got == N * BLOCK  # answered at once: no "ask again"
    assert p.stats.loads == 1
    p.after_alloc(req_id="q", block_ids=[list(range(40, 40 + N + 1))], num_external_tokens=N * BLOCK)
    plan = p.build()
    assert [(j.req_id, j.hashes) for j in plan.loads] == [("q", hs)] and plan.drops == []
    assert p.finished("q") is False and p.build().drops == []  # its load frees the prefetched bytes


def test_the_planner_drops_a_prefetch_whose_request_ends_before_its_load(
    client: BlockClient, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...]]
) -> None:
    _src, hs = stored
    p = planner(client)
    for req_id in ("aborted", "local"):
        p.arrived(req_id=req_id, block_hashes=hs, num_tokens=(N + 1) * BLOCK, token_ids=())
    assert sorted(j.req_id for j in prefetched(p, 2)) == ["aborted", "local"]
    p.finished("aborted")  # request_finished: vLLM calls it for an aborted waiting request too
    assert p.build().drops == ["aborted"]
    # vLLM's own prefix cache holds it all: no external tokens, no load, the prefetch is dropped
    local = N * BLOCK
    assert p.matched_tokens(req_id="local", block_hashes=hs, num_tokens=(N + 1) * BLOCK, num_computed_tokens=local) == 0
    p.after_alloc(req_id="local", block_ids=[list(range(N + 1))], num_external_tokens=0)
    plan = p.build()
    assert plan.loads == [] and plan.drops == ["local"]


def test_a_request_whose_blocks_were_stored_after_its_arrival_is_looked_up_again(
    client: BlockClient, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...]]
) -> None:
    """A request queued behind one with the same prompt: a miss at arrival, the blocks stored before it is admitted
    (by the one ahead): the admission looks it up again rather than take the arrival's stale miss."""
    src, _ = stored
    hs = hashes(80, N)
    p = planner(client)
    tokens = (N + 1) * BLOCK
    p.arrived(req_id="late", block_hashes=hs, num_tokens=tokens, token_ids=())
    assert p.wait_for_lookups(timeout_s=30.0)  # answered: a miss, so nothing to prefetch
    assert p.build().prefetches == []
    writer = reader(client, src, budget_blocks=0)
    writer.store(BlockJob(req_id="ahead", hashes=hs, block_ids=(tuple(range(N)),)))
    writer.wait_uploads(60)
    assert writer.stats.stored_blocks == N
    assert p.matched_tokens(req_id="late", block_hashes=hs, num_tokens=tokens, num_computed_tokens=0) is None
    p.wait_for_lookups(timeout_s=30.0)
    assert p.matched_tokens(req_id="late", block_hashes=hs, num_tokens=tokens, num_computed_tokens=0) == N * BLOCK


def test_a_load_served_from_prefetched_bytes_leaves_the_bandwidth_estimate_as_it_was(
    gateway: Gateway, client: BlockClient, stored: tuple[dict[str, torch.Tensor], tuple[bytes, ...]]
) -> None:
    """A prefetched load moves no bytes over the link while it is timed: it is no measure of the link. Counted as
    one (its GET bytes, none, over its scatter's time), it read as a link of almost no bandwidth, and the cost model
    skipped every hit after it (seen on the CPU engine: hits recomputed, slower than with kvgate off)."""
    _src, hs = stored
    r = reader(client, shard(full_kv(dtype=DTYPE, seed=72), tp=1, rank=0), budget_blocks=2 * N)
    prefetch(r, "q", hs)
    until(lambda: r.prefetch.ready(BlockJob(req_id="q", hashes=hs, block_ids=())))
    assert r.load(BlockJob(req_id="q", hashes=hs, block_ids=(tuple(range(30, 30 + N)),))).result(60) == set()
    outcome = r.take_outcomes()["q"]
    assert outcome.loaded == N and outcome.nbytes == 0
    block_bytes = r.transfers[0].block_bytes()
    p = SchedulerPlanner(  # a block recomputes in 100 ms: a link of the prior's bandwidth loads it far sooner
        client=client,
        keys=KeyScheme(namings=[run_naming(tp=1, rank=0, dtype=DTYPE)], num_groups=1),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        cost=CostModel(CostSettings(lookup_rtt_prior_s=0.0, prefill_tokens_s=BLOCK / 0.1)),
        block_bytes=block_bytes,
        lookup_deadline_s=5.0,
        prefetch_enabled=True,
    )
    assert p.cost is not None
    before = p.cost.bandwidth(now=time.monotonic())
    p.loaded(req_id="q", outcome=outcome)  # the workers' report reaches the scheduler
    assert p.cost.bandwidth(now=time.monotonic()) >= before * 0.99
    tokens = (N + 1) * BLOCK
    assert p.matched_tokens(req_id="next", block_hashes=hs, num_tokens=tokens, num_computed_tokens=0) is None
    until(
        lambda: p.matched_tokens(req_id="next", block_hashes=hs, num_tokens=tokens, num_computed_tokens=0) is not None
    )
    assert p.matched_tokens(req_id="next", block_hashes=hs, num_tokens=tokens, num_computed_tokens=0) == N * BLOCK
    assert p.stats.skipped == 0
