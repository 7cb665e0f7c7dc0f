"""A P/D consumer's wait for its producer's blocks: never longer than its recompute would take, and that recompute
counted behind the prefill queued ahead of it. A real gateway; the producer's stores land late, as on a producer
busy with 16 prompts at once: the requests at the back of the consumer's queue wait for them and load, the ones at
the front (whose recompute is shorter than the wait) recompute."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from connector.http.client import BlockClient, ClientConfig
from connector.planning.cost import CostModel, CostSettings
from connector.planning.handoff import Expected
from connector.planning.plan import BlockJob, KeyScheme, SchedulerPlanner
from tests.connector.test_pipeline import BLOCK, full_kv, hashes, run_naming, shard
from tests.connector.test_prefetch import reader
from tests.gateway import Gateway, free_port

DTYPE = torch.bfloat16
BLOCKS = 2  # per request
PROMPT = BLOCKS * BLOCK + 5
ONE_RECOMPUTE_S = 0.5  # the prefill rate the consumer has measured: one prompt in 0.5 s
REQUESTS = 8
STORES_LATE_S = 1.0


def consumer(client: BlockClient, *, prefill_tokens_s: float, lookup_enabled: bool = True) -> SchedulerPlanner:
    """A P/D consumer's scheduler side that has measured ``prefill_tokens_s`` (0: nothing measured yet)."""
    return SchedulerPlanner(
        client=client,
        keys=KeyScheme(namings=[run_naming(tp=1, rank=0, dtype=DTYPE)], num_groups=1),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        cost=CostModel(CostSettings(lookup_rtt_prior_s=0.0, prefill_tokens_s=prefill_tokens_s)),
        block_bytes=1,
        lookup_deadline_s=5.0,
        lookup_enabled=lookup_enabled,
        store_enabled=False,
    )


@pytest.fixture
def client(gateway: Gateway) -> Iterator[BlockClient]:
    with BlockClient(ClientConfig(base_url=gateway.url)) as c:
        yield c


def test_the_back_of_the_queue_waits_for_late_stores_and_loads(gateway: Gateway, client: BlockClient) -> None:
    d = consumer(client, prefill_tokens_s=PROMPT / ONE_RECOMPUTE_S)
    reqs = [(f"r{i}", hashes(300 + i, BLOCKS)) for i in range(REQUESTS)]
    waits = []
    for req_id, hs in reqs:  # the consumer's scheduler reaches each request in turn; none is stored yet
        wait_s = d.handoff_wait_s(req_id=req_id, tokens=PROMPT, most_s=30.0)
        waits.append(wait_s)
        got = d.matched_tokens(
            req_id=req_id,
            block_hashes=list(hs),
            num_tokens=PROMPT,
            num_computed_tokens=0,
            expect=Expected(blocks=BLOCKS, wait_s=wait_s),
        )
        assert got is None  # waiting on the gateway
    # the k-th request's recompute waits for the k prompts ahead of it: the cap grows down the queue
    assert waits == pytest.approx([ONE_RECOMPUTE_S * (k + 1) for k in range(REQUESTS)], rel=1e-6)
    time.sleep(STORES_LATE_S)
    writer = reader(client, shard(full_kv(dtype=DTYPE, seed=80), tp=1, rank=0), budget_blocks=0)
    for i, (req_id, hs) in enumerate(reqs):  # the producer's stores land, late
        writer.store(
            BlockJob(req_id=req_id, hashes=hs, block_ids=(tuple(range(i * BLOCKS, (i + 1) * BLOCKS)),), keep=True)
        )
    writer.wait_uploads(60)
    assert writer.stats.stored_blocks == REQUESTS * BLOCKS
    answers: dict[str, int] = {}
    deadline = time.monotonic() + 30
    while len(answers) < REQUESTS and time.monotonic() < deadline:
        for req_id, hs in reqs:
            if req_id not in answers:
                n = d.matched_tokens(req_id=req_id, block_hashes=list(hs), num_tokens=PROMPT, num_computed_tokens=0)
                if n is not None:
                    answers[req_id] = n
        time.sleep(0.01)
    for req_id, _ in reqs:
        d.finished(req_id)
    assert d.cost is not None and d.cost.lookup_rtt.value < 0.2  # waits on the producer are not round trips
    got = [answers[r] for r, _ in reqs]
    assert got[0] == 0  # its recompute (0.5 s) is shorter than the producer's stores took: it did not wait them out
    assert got[-1] == BLOCKS * BLOCK  # behind 7 prompts, its recompute would take 4 s: it waited and loads
    first_hit = got.index(BLOCKS * BLOCK)
    assert got[first_hit:] == [BLOCKS * BLOCK] * (REQUESTS - first_hit), got  # once worth the wait, so behind it


def test_prefill_done_or_loading_ahead_is_not_counted() -> None:
    with BlockClient(ClientConfig(base_url=f"http://127.0.0.1:{free_port()}")) as c:
        d = consumer(c, prefill_tokens_s=100.0, lookup_enabled=False)
        assert d.handoff_wait_s(req_id="x", tokens=100, most_s=30.0) == pytest.approx(1.0)  # an empty queue
        d.matched_tokens(req_id="a", block_hashes=list(hashes(1, 3)), num_tokens=300, num_computed_tokens=0)
        assert d.handoff_wait_s(req_id="x", tokens=100, most_s=30.0) == pytest.approx(4.0)  # behind a's 300
        assert d.handoff_wait_s(req_id="a", tokens=300, most_s=30.0) == pytest.approx(3.0)  # not behind itself
        d.scheduled(req_id="a", new_block_ids=None, num_computed_tokens=0, num_scheduled_tokens=200)
        assert d.handoff_wait_s(req_id="x", tokens=100, most_s=30.0) == pytest.approx(2.0)  # 100 of a's left
        assert d.handoff_wait_s(req_id="x", tokens=100, most_s=1.5) == pytest.approx(1.5)  # handoff_wait_ms
        d.scheduled(req_id="a", new_block_ids=None, num_computed_tokens=200, num_scheduled_tokens=100)
        assert d.handoff_wait_s(req_id="x", tokens=100, most_s=30.0) == pytest.approx(1.0)  # a decodes now
        d.finished("a")
        unmeasured = consumer(c, prefill_tokens_s=0.0, lookup_enabled=False)
        assert unmeasured.handoff_wait_s(req_id="x", tokens=100, most_s=2.0) == 2.0  # no prefill rate: the most
