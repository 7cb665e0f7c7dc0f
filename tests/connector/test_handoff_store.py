"""A P/D producer's stores (``BlockJob.keep``) wait, bounded, for buffer room instead of being dropped.

A real gateway; one store buffer of one block, so that every block after the first finds no room while the one
before it is uploading."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from connector.device.transfer import BlockTransfer, KVLayout
from connector.http.client import BlockClient, ClientConfig
from connector.worker.pipeline import WorkerPipeline
from loopback.proxy import proxy
from tests.connector.test_pipeline import LAYER_NAMES, full_kv, hashes, job, load, run_naming, same, shard
from tests.gateway import Gateway

DTYPE = torch.bfloat16
N = 6


def one_buffer(client: BlockClient, kv: dict[str, torch.Tensor]) -> WorkerPipeline:
    transfer = BlockTransfer(kv_caches=kv, layout=KVLayout.NHD, max_blocks_per_batch=1, store_buffers=1, load_buffers=2)
    return WorkerPipeline(
        client=client, naming=run_naming(tp=1, rank=0, dtype=DTYPE), transfers=[transfer], tp_size=1, tp_rank=0
    )


@pytest.fixture
def bc(gateway: Gateway) -> Iterator[BlockClient]:
    with BlockClient(ClientConfig(base_url=gateway.url)) as c:
        yield c


def test_a_best_effort_store_without_room_is_dropped(bc: BlockClient) -> None:
    writer = one_buffer(bc, shard(full_kv(dtype=DTYPE, seed=70), tp=1, rank=0))
    writer.store(job("w", hashes(70, N), list(range(N))))
    writer.wait_uploads(60)
    assert writer.stats.dropped_blocks > 0  # the setting below drops: what keep is measured against
    assert writer.stats.stored_blocks == N - writer.stats.dropped_blocks
    assert writer.stats.dropped_kept_blocks == 0


def test_a_handoff_store_waits_for_room_and_stores_every_block(bc: BlockClient) -> None:
    src = shard(full_kv(dtype=DTYPE, seed=71), tp=1, rank=0)
    writer = one_buffer(bc, src)
    hs = hashes(71, N)
    writer.store(dataclasses.replace(job("w", hs, list(range(N))), keep=True))
    writer.wait_uploads(60)
    assert writer.stats.dropped_blocks == 0 and writer.stats.dropped_kept_blocks == 0
    assert writer.stats.stored_blocks == N
    assert writer.stats.keep_waits > 0
    dest = shard(full_kv(dtype=DTYPE, seed=72), tp=1, rank=0)
    reader = one_buffer(bc, dest)
    ids = list(range(20, 20 + N))
    assert load(reader, job("r", hs, ids)) == set()
    for name in LAYER_NAMES:
        for s, d in enumerate(ids):
            assert same(dest[name][:, d], src[name][:, s])


def test_a_handoff_store_still_without_room_after_its_wait_is_counted(gateway: Gateway) -> None:
    """A gateway that stops answering: the first upload never ends, so no room comes back; the producer waits
    ``keep_wait_s`` once per batch, then drops the batch and counts it apart."""
    with (
        proxy(upstream_port=gateway.port, pass_bytes=0) as link,
        BlockClient(ClientConfig(base_url=link.url, request_timeout_s=20.0, retries=0)) as c,
    ):
        writer = one_buffer(c, shard(full_kv(dtype=DTYPE, seed=73), tp=1, rank=0))
        writer.keep_wait_s = 0.3
        writer.store(dataclasses.replace(job("w", hashes(73, 3), [0, 1, 2]), keep=True))
        assert writer.stats.dropped_kept_blocks == 2 and writer.stats.dropped_blocks == 2
        assert writer.stats.keep_waits == 2
        link.pass_bytes = None  # let the stalled upload finish, so the client closes cleanly
        writer.wait_uploads(30)
