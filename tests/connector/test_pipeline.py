"""Store/load round trips of a synthetic model through a running gateway, on CPU tensors: bytes equal, cross-TP,
non-agnostic runs, and faults (gateway down or restarted, a corrupt file, a partial set of parts)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from connector.device.transfer import BlockTransfer, KVLayout
from connector.http.client import BlockClient, ClientConfig
from connector.planning.plan import BlockJob, KeyScheme, SchedulerPlanner
from contract.keys import KVGroup, RunNaming, naming
from contract.wire import RANGE_CHECKSUM_HEADER
from tests.conftest import crc_header
from tests.gateway import Gateway, free_port

LAYERS, HEADS, HEAD_SIZE, BLOCK = 4, 8, 128, 16
NUM_BLOCKS = 48
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))


def full_kv(*, dtype: torch.dtype, seed: int, heads: int = HEADS) -> torch.Tensor:
    """All layers of a TP=1 model, ``(layer, 2, blocks, token, head, dim)``, random bits (byte-exact checks)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (LAYERS, 2, NUM_BLOCKS, BLOCK, heads, HEAD_SIZE), generator=g)
    return bits.to(torch.int16).view(dtype)


def shard(full: torch.Tensor, *, tp: int, rank: int) -> dict[str, torch.Tensor]:
    per = full.shape[4] // tp
    return {name: full[i, :, :, :, rank * per : (rank + 1) * per].contiguous() for i, name in enumerate(LAYER_NAMES)}


def run_naming(*, tp: int, rank: int, dtype: torch.dtype, mla: bool = False, groups: int = 1) -> RunNaming:
    kv_groups = [KVGroup(tokens_per_block=BLOCK, layer_names=LAYER_NAMES, mla=mla) for _ in range(groups)]
    heads = 1 if mla else HEADS
    return naming(
        model_name="test-org/synthetic",
        tokens_per_hash=BLOCK,
        tp_size=tp,
        rank=rank,
        dtype=str(dtype).removeprefix("torch."),
        groups=kv_groups,
        num_kv_heads=heads if mla else heads // tp,
        total_kv_heads=heads,
    )


def pipeline(client: BlockClient, kv: dict[str, torch.Tensor], naming_: RunNaming, *, tp: int, rank: int):  # type: ignore[no-untyped-def]
    from connector.worker.pipeline import WorkerPipeline

    transfer = BlockTransfer(kv_caches=kv, layout=KVLayout.NHD, max_blocks_per_batch=4, store_buffers=8, load_buffers=4)
    return WorkerPipeline(client=client, naming=naming_, transfers=[transfer], tp_size=tp, tp_rank=rank)


def hashes(prefix: int, n: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{prefix}/{i}".encode()).digest() for i in range(n))


def job(req: str, hs: tuple[bytes, ...], ids: list[int]) -> BlockJob:
    return BlockJob(req_id=req, hashes=hs, block_ids=(tuple(ids),))


def load(p, j: BlockJob) -> set[int]:  # type: ignore[no-untyped-def]
    return p.load(j).result(timeout=60)


def rot(path: Path, *, at_fraction: float, mask: int) -> None:
    """Bit rot: one byte of the file changed in place (``mask`` xored in), its inode and mtime kept."""
    st = path.stat()
    at = int(st.st_size * at_fraction)
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ mask]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def bc(gateway: Gateway) -> Iterator[BlockClient]:
    with BlockClient(ClientConfig(base_url=gateway.url, max_connections=16)) as c:
        yield c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_trip_prefixes_into_fresh_kv(bc: BlockClient, dtype: torch.dtype) -> None:
    src = shard(full_kv(dtype=dtype, seed=1), tp=1, rank=0)
    writer = pipeline(bc, src, run_naming(tp=1, rank=0, dtype=dtype), tp=1, rank=0)
    prefixes = {p: (hashes(p, 3 + p), list(range(p * 8, p * 8 + 3 + p))) for p in range(3)}
    for p, (hs, ids) in prefixes.items():
        writer.store(job(f"w{p}", hs, ids))
    writer.wait_uploads(60)
    assert writer.stats.stored_blocks == sum(len(hs) for hs, _ in prefixes.values())
    fresh = shard(full_kv(dtype=dtype, seed=2), tp=1, rank=0)
    before = {k: v.clone() for k, v in fresh.items()}
    reader = pipeline(bc, fresh, run_naming(tp=1, rank=0, dtype=dtype), tp=1, rank=0)
    touched: set[int] = set()
    for p, (hs, ids) in prefixes.items():
        dest = [40 - i - p * 6 for i in range(len(ids))]  # other block ids than the writer's
        assert load(reader, job(f"r{p}", hs, dest)) == set()
        for s, d in zip(ids, dest, strict=True):
            touched.add(d)
            for name in LAYER_NAMES:
                assert same(fresh[name][:, d], src[name][:, s]), (p, s, d, name)
    for name in LAYER_NAMES:
        for b in set(range(NUM_BLOCKS)) - touched:
            assert same(fresh[name][:, b], before[name][:, b]), (name, b)
    assert reader.stats.loaded_blocks == len(touched)


def test_cross_tp_parts_load_at_tp2_and_tp1(bc: BlockClient) -> None:
    dtype = torch.bfloat16
    full = full_kv(dtype=dtype, seed=3)
    hs, ids = hashes(10, 5), [3, 7, 11, 12, 20]
    namings = [run_naming(tp=4, rank=r, dtype=dtype) for r in range(4)]
    assert all(n.parallel_agnostic and n.rank == 0 for n in namings)
    assert len({n.namespace for n in namings}) == 1
    assert run_naming(tp=1, rank=0, dtype=dtype).namespace == namings[0].namespace
    writers = [pipeline(bc, shard(full, tp=4, rank=r), namings[r], tp=4, rank=r) for r in range(4)]
    for w in writers:
        w.store(job("w", hs, ids))
    for w in writers:
        w.wait_uploads(60)
    dest = [30, 31, 32, 33, 34]
    for tp in (2, 1):
        for rank in range(tp):
            kv = shard(full_kv(dtype=dtype, seed=4), tp=tp, rank=rank)
            reader = pipeline(bc, kv, run_naming(tp=tp, rank=rank, dtype=dtype), tp=tp, rank=rank)
            assert load(reader, job(f"r{tp}{rank}", hs, dest)) == set(), (tp, rank)
            want = shard(full, tp=tp, rank=rank)
            for s, d in zip(ids, dest, strict=True):
                for name in LAYER_NAMES:
                    assert same(kv[name][:, d], want[name][:, s]), (tp, rank, s, name)


@pytest.mark.parametrize("kind", ["mla", "two_groups"])
def test_non_agnostic_keeps_rank_paths(bc: BlockClient, kind: str) -> None:
    dtype = torch.float16
    mla, groups = (True, 1) if kind == "mla" else (False, 2)
    heads = 1 if mla else HEADS
    full = full_kv(dtype=dtype, seed=5, heads=heads)
    n0, n1 = (run_naming(tp=2, rank=r, dtype=dtype, mla=mla, groups=groups) for r in range(2))
    assert not n0.parallel_agnostic and (n0.rank, n1.rank) == (0, 1)
    assert n0.namespace == n1.namespace  # one run, rank in the path
    hs, ids = hashes(20, 3), [1, 2, 3]
    tp_shard = (lambda r: shard(full, tp=1, rank=0)) if mla else (lambda r: shard(full, tp=2, rank=r))
    for r, n in enumerate((n0, n1)):
        w = pipeline(bc, tp_shard(r), n, tp=2, rank=r)
        w.store(job("w", hs, ids))
        w.wait_uploads(60)
        assert w.stats.stored_blocks == 3
    same_tp = pipeline(bc, tp_shard(1), run_naming(tp=2, rank=1, dtype=dtype, mla=mla, groups=groups), tp=2, rank=1)
    assert load(same_tp, job("r", hs, [5, 6, 7])) == set()
    other = run_naming(tp=1, rank=0, dtype=dtype, mla=mla, groups=groups)
    assert other.namespace != n0.namespace
    kv = shard(full, tp=1, rank=0)
    before = {k: v.clone() for k, v in kv.items()}
    reader = pipeline(bc, kv, other, tp=1, rank=0)
    assert load(reader, job("r1", hs, [5, 6, 7])) == {5, 6, 7}  # a miss, not another rank's bytes
    assert all(same(kv[k], before[k]) for k in kv)


def test_gateway_down_drops_and_counts(tmp_path: Path) -> None:
    cfg = ClientConfig(base_url=f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01, down_cooldown_s=30)
    with BlockClient(cfg) as c:
        kv = shard(full_kv(dtype=torch.bfloat16, seed=6), tp=1, rank=0)
        p = pipeline(c, kv, run_naming(tp=1, rank=0, dtype=torch.bfloat16), tp=1, rank=0)
        for i in range(5):
            p.store(job(f"w{i}", hashes(30 + i, 4), [0, 1, 2, 3]))
        p.wait_uploads(60)
        assert p.stats.stored_blocks == 0
        assert p.stats.failed_blocks + p.stats.dropped_blocks == 20
        assert c.stats.failed_stores == p.stats.failed_blocks
        assert load(p, job("r", hashes(30, 4), [4, 5, 6, 7])) == {4, 5, 6, 7}
        assert c.inflight_bytes == 0


def test_gateway_restarted_mid_run(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data").start()
    dtype = torch.bfloat16
    src = shard(full_kv(dtype=dtype, seed=7), tp=1, rank=0)
    try:
        with BlockClient(ClientConfig(base_url=gw.url, retries=2, backoff_s=0.05, down_cooldown_s=0.2)) as c:
            p = pipeline(c, src, run_naming(tp=1, rank=0, dtype=dtype), tp=1, rank=0)
            p.store(job("a", hashes(40, 4), [0, 1, 2, 3]))
            p.wait_uploads(60)
            gw.kill9()
            gw.start()
            p.store(job("b", hashes(41, 4), [4, 5, 6, 7]))
            p.wait_uploads(60)
            assert p.stats.stored_blocks == 8
            kv = shard(full_kv(dtype=dtype, seed=8), tp=1, rank=0)
            r = pipeline(c, kv, run_naming(tp=1, rank=0, dtype=dtype), tp=1, rank=0)
            assert load(r, job("ra", hashes(40, 4), [10, 11, 12, 13])) == set()
            assert load(r, job("rb", hashes(41, 4), [14, 15, 16, 17])) == set()
            assert all(same(kv[n][:, 10 + i], src[n][:, i]) for n in LAYER_NAMES for i in range(8))
    finally:
        gw.stop()


def test_corrupt_object_is_a_miss_not_a_load(bc: BlockClient, gateway: Gateway) -> None:
    dtype = torch.float16
    src = shard(full_kv(dtype=dtype, seed=9), tp=1, rank=0)
    nm = run_naming(tp=1, rank=0, dtype=dtype)
    hs = hashes(50, 4)
    w = pipeline(bc, src, nm, tp=1, rank=0)
    w.store(job("w", hs, [0, 1, 2, 3]))
    w.wait_uploads(60)
    rot(gateway.data_dir / "blocks" / nm.block(hs[2]), at_fraction=0.5, mask=0x5A)
    kv = shard(full_kv(dtype=dtype, seed=10), tp=1, rank=0)
    before = {k: v.clone() for k, v in kv.items()}
    r = pipeline(bc, kv, nm, tp=1, rank=0)
    assert load(r, job("r", hs, [20, 21, 22, 23])) == {22, 23}
    assert bc.stats.corrupt_reads == 1
    for n in LAYER_NAMES:
        assert same(kv[n][:, 20], src[n][:, 0]) and same(kv[n][:, 21], src[n][:, 1])
        assert same(kv[n][:, 22], before[n][:, 22]) and same(kv[n][:, 23], before[n][:, 23])


def test_a_rotten_block_is_never_loaded_and_the_scrub_removes_it_within_its_period(tmp_path: Path) -> None:
    """Bit rot after the store (bytes changed in place, stamp and mtime kept: the gateway cannot tell from the file):
    the connector's check refuses the rotten block (the rest of the prefix loads; vLLM recomputes from there), and the
    scrub, one pass a second here, quarantines it and removes its row within a few periods: the lookup then stops
    the prefix before it, so no reader even asks."""
    period_s = 1.0
    gw = Gateway(tmp_path / "data", env={"KVGATE_SCRUB_INTERVAL_S": str(period_s), "KVGATE_SCRUB_DELAY_S": "0"})
    gw.start()
    try:
        with BlockClient(ClientConfig(base_url=gw.url, max_connections=8)) as client:
            dtype = torch.bfloat16
            src = shard(full_kv(dtype=dtype, seed=31), tp=1, rank=0)
            nm = run_naming(tp=1, rank=0, dtype=dtype)
            hs = hashes(90, 4)
            w = pipeline(client, src, nm, tp=1, rank=0)
            w.store(job("w", hs, [0, 1, 2, 3]))
            w.wait_uploads(60)
            rot(gw.data_dir / "blocks" / nm.block(hs[1]), at_fraction=1 / 3, mask=0x10)
            rotted = time.monotonic()
            kv = shard(full_kv(dtype=dtype, seed=32), tp=1, rank=0)
            before = {k: v.clone() for k, v in kv.items()}
            # refused by the connector's check (corrupt_reads 1), or a miss if the scrub came first (404)
            assert load(pipeline(client, kv, nm, tp=1, rank=0), job("r", hs, [10, 11, 12, 13])) == {11, 12, 13}
            assert client.stats.corrupt_reads <= 1
            for n in LAYER_NAMES:
                assert same(kv[n][:, 10], src[n][:, 0])
                assert same(kv[n][:, 11], before[n][:, 11])  # never the rotten bytes, whoever refused them
            keys = [nm.block(h) for h in hs]
            while httpx.post(f"{gw.url}/v1/lookup", json={"keys": keys}).json()["prefix"] != 1:
                assert time.monotonic() - rotted < 20 * period_s, "the scrub did not remove the rotten block"
                time.sleep(0.1)
            assert len(list((gw.data_dir / "blocks").rglob(".kvgate-corrupt-*"))) == 1
    finally:
        gw.stop()


def test_corrupt_object_is_a_miss_for_range_readers(bc: BlockClient, gateway: Gateway) -> None:
    """A TP=2 reader asks for a byte range; the gateway checks the whole object at rest before vouching for it."""
    dtype = torch.bfloat16
    full = full_kv(dtype=dtype, seed=12)
    hs = hashes(70, 2)
    for r in range(4):
        w = pipeline(bc, shard(full, tp=4, rank=r), run_naming(tp=4, rank=r, dtype=dtype), tp=4, rank=r)
        w.store(job("w", hs, [0, 1]))
        w.wait_uploads(60)
    nm = run_naming(tp=2, rank=0, dtype=dtype)
    intact = httpx.get(f"{gateway.url}/v1/blocks/{nm.block(hs[0])}", headers={"Range": "bytes=0-99"})
    assert intact.status_code == 206 and intact.headers[RANGE_CHECKSUM_HEADER] == crc_header(intact.content)
    path = gateway.data_dir / "blocks" / nm.block(hs[1])
    raw = bytearray(path.read_bytes())
    raw[len(raw) * 3 // 4] ^= 0x5A  # in rank 1's half: rank 0's range is intact, the object is not
    path.write_bytes(bytes(raw))
    corrupt_before = bc.stats.corrupt_reads
    for rank in range(2):
        kv = shard(full_kv(dtype=dtype, seed=13), tp=2, rank=rank)
        before = {k: v.clone() for k, v in kv.items()}
        reader = pipeline(bc, kv, run_naming(tp=2, rank=rank, dtype=dtype), tp=2, rank=rank)
        assert load(reader, job(f"r{rank}", hs, [8, 9])) == {9}, rank
        want = shard(full, tp=2, rank=rank)
        for n in LAYER_NAMES:
            assert same(kv[n][:, 8], want[n][:, 0])
            assert same(kv[n][:, 9], before[n][:, 9])
    assert bc.stats.corrupt_reads == corrupt_before  # the gateway refused (404): nothing wrong reached the client


def test_partial_parts_are_a_miss(bc: BlockClient) -> None:
    dtype = torch.bfloat16
    full = full_kv(dtype=dtype, seed=11)
    hs = hashes(60, 2)
    for r in range(3):  # rank 3 never writes
        w = pipeline(bc, shard(full, tp=4, rank=r), run_naming(tp=4, rank=r, dtype=dtype), tp=4, rank=r)
        w.store(job("w", hs, [0, 1]))
        w.wait_uploads(60)
    for tp in (1, 2, 4):
        r = pipeline(bc, shard(full, tp=tp, rank=0), run_naming(tp=tp, rank=0, dtype=dtype), tp=tp, rank=0)
        assert load(r, job("r", hs, [8, 9])) == {8, 9}, tp
    prefix, _ = bc.run(bc.lookup([run_naming(tp=1, rank=0, dtype=dtype).block(h) for h in hs]))
    assert prefix == 0


def test_scheduler_plans_one_lookup_loads_and_stores(bc: BlockClient) -> None:
    dtype = torch.bfloat16
    nm = run_naming(tp=1, rank=0, dtype=dtype)
    src = shard(full_kv(dtype=dtype, seed=12), tp=1, rank=0)
    hs = hashes(70, 5)
    w = pipeline(bc, src, nm, tp=1, rank=0)
    w.store(job("w", hs[:3], [0, 1, 2]))
    w.wait_uploads(60)
    planner = SchedulerPlanner(
        client=bc, keys=KeyScheme(namings=[nm], num_groups=1), block_size=BLOCK, hash_block_size=BLOCK, lookup_wait_s=10
    )
    live = list(hs)
    tokens = list(range(100, 100 + 5 * BLOCK + 3))  # vLLM's all_token_ids of the request

    def matched(req_id: str, hashes_: list[bytes], num_tokens: int) -> int | None:
        """As vLLM asks: "ask again" (None) until the lookup answered; an idle step waits for it (``build``)."""
        kw = {"req_id": req_id, "block_hashes": hashes_, "num_tokens": num_tokens, "num_computed_tokens": 0}
        got = planner.matched_tokens(**kw, token_ids=tokens[:num_tokens])
        if got is None:
            assert planner.build(idle=True).loads == []
            got = planner.matched_tokens(**kw, token_ids=tokens[:num_tokens])
        return got

    assert matched("q", live, 5 * BLOCK + 3) == 3 * BLOCK
    planner.after_alloc(req_id="q", block_ids=[[9, 8, 7, 6, 5, 4]], num_external_tokens=3 * BLOCK)
    planner.scheduled(req_id="q", new_block_ids=None, num_computed_tokens=3 * BLOCK, num_scheduled_tokens=2 * BLOCK + 3)
    plan = planner.build()
    assert plan.loads == [BlockJob(req_id="q", hashes=hs[:3], block_ids=((9, 8, 7),))]
    # each stored block says its tokens and its parent's hash (the block before it), as vLLM's BlockStored does
    metas = tuple(
        f"parent={hs[i - 1].hex()}; tokens=" + ",".join(map(str, tokens[i * BLOCK : (i + 1) * BLOCK])) for i in (3, 4)
    )
    assert plan.stores == [BlockJob(req_id="q", hashes=hs[3:5], block_ids=((6, 5),), metas=metas)]
    assert planner.build().loads == []
    # everything present: the last block is left for vLLM to compute
    assert matched("z", list(hs[:3]), 3 * BLOCK) == 2 * BLOCK
    assert planner.finished("q") is True  # stores were planned: vLLM must keep its blocks until the copies are done
    assert planner.finished("z") is False
    assert planner.tracked == 0
