"""Blocks/s and MB/s of the connector's CPU store and load pipelines against a running kvgate.

    .venv/bin/python -m benchmarks.connector.pipeline [--blocks 96] [--layers 32] [--busy 1]

Synthetic model: ``--layers`` layers, 8 KV heads, head 128, block 16, bf16 (2 MiB canonical blocks at 32 layers).
Cells: TP=1 store (gather -> PUT) and load (GET -> scatter); TP=4 store as parts (4 writer ranks) and a TP=1 load
of the assembled objects; and, as the baseline in the same run, bare BlockClient PUT/GET of the same bytes.
``--busy N`` keeps N other processes spinning on the CPU for the whole run (a machine with other work on it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from connector.device.transfer import BlockTransfer, KVLayout
from connector.http.client import BlockClient, ClientConfig
from connector.planning.plan import BlockJob
from connector.worker.pipeline import WorkerPipeline
from contract.keys import KVGroup, RunNaming, naming
from loopback.gateway import Gateway

HEADS, HEAD, BLOCK = 8, 128, 16


def kv(layers: int, blocks: int, heads: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"l.{i}": torch.randint(-(2**15), 2**15, (2, blocks, BLOCK, heads, HEAD), generator=g)
        .to(torch.int16)
        .view(torch.bfloat16)
        for i in range(layers)
    }


def run_naming(layers: int, tp: int, rank: int) -> RunNaming:
    group = KVGroup(tokens_per_block=BLOCK, layer_names=tuple(f"l.{i}" for i in range(layers)))
    return naming(
        model_name="bench/model",
        tokens_per_hash=BLOCK,
        tp_size=tp,
        rank=rank,
        dtype="bfloat16",
        groups=[group],
        num_kv_heads=HEADS // tp,
        total_kv_heads=HEADS,
    )


def make(client: BlockClient, caches: dict[str, torch.Tensor], nm: RunNaming, tp: int, rank: int) -> WorkerPipeline:
    # enough store buffers for every block in flight at once: this measures throughput, not the drop policy
    buffers = next(iter(caches.values())).shape[1] // 8 + 1
    t = BlockTransfer(
        kv_caches=caches, layout=KVLayout.NHD, max_blocks_per_batch=8, store_buffers=buffers, load_buffers=4
    )
    return WorkerPipeline(client=client, naming=nm, transfers=[t], tp_size=tp, tp_rank=rank)


def jobs(tag: str, n: int, per_job: int) -> list[BlockJob]:
    out = []
    for j in range(0, n, per_job):
        ids = tuple(range(j, min(n, j + per_job)))
        hs = tuple(hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in ids)
        out.append(BlockJob(req_id=f"{tag}{j}", hashes=hs, block_ids=(ids,)))
    return out


def timed_store(pipes: list[WorkerPipeline], work: list[BlockJob]) -> float:
    start = time.perf_counter()
    for job in work:
        for p in pipes:
            p.store(job)
    for p in pipes:
        p.wait_uploads(600)
    return time.perf_counter() - start


def timed_load(pipe: WorkerPipeline, work: list[BlockJob]) -> tuple[float, int]:
    start = time.perf_counter()
    futs = [pipe.load(job) for job in work]
    failed = sum(len(f.result(timeout=600)) for f in futs)
    return time.perf_counter() - start, failed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--per-request", type=int, default=16)
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU meanwhile")
    args = ap.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run(args)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace) -> None:
    n, layers = args.blocks, args.layers
    block_bytes = layers * 2 * BLOCK * HEADS * HEAD * 2
    with tempfile.TemporaryDirectory() as tmp:
        gw = Gateway(Path(tmp) / "data", env={"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "false"}).start()
        cfg = ClientConfig(base_url=gw.url, max_connections=16, max_inflight_bytes=4 << 30)
        try:
            with BlockClient(cfg) as client:
                rows: list[tuple[str, float, int]] = []
                # baseline: bare client PUT/GET of equal-sized bodies
                body = os.urandom(block_bytes)
                keys = [run_naming(layers, 1, 0).block(hashlib.sha256(f"raw/{i}".encode()).digest()) for i in range(n)]
                start = time.perf_counter()
                concurrent.futures.wait([client.submit(client.put(k, body)) for k in keys])
                rows.append(("raw PUT (baseline)", time.perf_counter() - start, 0))
                start = time.perf_counter()
                got = [client.submit(client.get(k)) for k in keys]
                concurrent.futures.wait(got)
                rows.append(("raw GET (baseline)", time.perf_counter() - start, sum(f.result() is None for f in got)))

                src = kv(layers, n, HEADS, seed=1)
                w = make(client, src, run_naming(layers, 1, 0), 1, 0)
                work = jobs("tp1", n, args.per_request)
                rows.append(("store TP=1", timed_store([w], work), w.stats.dropped_blocks + w.stats.failed_blocks))
                r = make(client, kv(layers, n, HEADS, seed=2), run_naming(layers, 1, 0), 1, 0)
                rows.append(("load TP=1", *timed_load(r, work)))

                shards = [{k: v[..., rk * 2 : rk * 2 + 2, :].contiguous() for k, v in src.items()} for rk in range(4)]
                writers = [make(client, shards[rk], run_naming(layers, 4, rk), 4, rk) for rk in range(4)]
                work4 = jobs("tp4", n, args.per_request)
                lost = 0
                t = timed_store(writers, work4)
                lost = sum(x.stats.dropped_blocks + x.stats.failed_blocks for x in writers)
                rows.append(("store TP=4 parts (4 ranks)", t, lost))
                rows.append(("load TP=1 of TP=4 parts", *timed_load(r, work4)))

                base_put, base_get = rows[0][1], rows[1][1]
                print(
                    f"{n} blocks of {block_bytes / 2**20:.2f} MiB ({layers} layers, 8 KV heads, head 128, block 16)"
                    + (f", {args.busy} busy process(es) beside" if args.busy else "")
                )
                print(f"{'cell':28} {'blocks/s':>9} {'MB/s':>8} {'lost':>5} {'vs raw':>7}")
                for name, secs, lost_blocks in rows:
                    base = base_get if "load" in name or "GET" in name else base_put
                    print(
                        f"{name:28} {n / secs:>9.1f} {n * block_bytes / 1e6 / secs:>8.1f} {lost_blocks:>5} "
                        f"{base / secs:>7.2f}"
                    )
        finally:
            gw.stop()


if __name__ == "__main__":
    main()
