"""httpx.AsyncClient vs aiohttp against a running kvgate: 2 MiB PUT/GET at 8-32 connections, and HEAD.

    .venv/bin/python -m benchmarks.primitives.http_clients [--ops 96] [--size-mib 2]

Starts its own gateway (filesystem backend, fsync off so the disk does not dominate) on loopback, runs each
(client, op, connections) cell once over the same keys and prints ops/s, MB/s and the aiohttp/httpx ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx

from contract.keys import block_path
from loopback.gateway import Gateway

NS = "bench-model_0123456789ab"
Op = Callable[[int], Awaitable[None]]


def key(i: int) -> str:
    return block_path(namespace=NS, rank=0, block_hash=hashlib.sha256(str(i).encode()).digest(), group=0)


async def run_cell(op: Op, *, ops: int, conns: int) -> float:
    sem = asyncio.Semaphore(conns)

    async def one(i: int) -> None:
        async with sem:
            await op(i)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(ops)))
    return time.perf_counter() - start


async def bench_httpx(url: str, body: bytes, *, ops: int, conns: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as c:

        async def put(i: int) -> None:
            (await c.put(f"/v1/blocks/{key(i)}", content=body)).raise_for_status()

        async def get(i: int) -> None:
            r = await c.get(f"/v1/blocks/{key(i)}")
            r.raise_for_status()
            if len(r.content) != len(body):
                raise RuntimeError("short read")

        async def head(i: int) -> None:
            (await c.head(f"/v1/blocks/{key(i % ops)}")).raise_for_status()

        return {
            "PUT": await run_cell(put, ops=ops, conns=conns),
            "GET": await run_cell(get, ops=ops, conns=conns),
            "HEAD": await run_cell(head, ops=ops * 10, conns=conns),
        }


async def bench_aiohttp(url: str, body: bytes, *, ops: int, conns: int) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=conns)
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as s:

        async def put(i: int) -> None:
            async with s.put(f"/v1/blocks/{key(i)}", data=body) as r:
                r.raise_for_status()
                await r.read()

        async def get(i: int) -> None:
            async with s.get(f"/v1/blocks/{key(i)}") as r:
                r.raise_for_status()
                if len(await r.read()) != len(body):
                    raise RuntimeError("short read")

        async def head(i: int) -> None:
            async with s.head(f"/v1/blocks/{key(i % ops)}") as r:
                r.raise_for_status()

        return {
            "PUT": await run_cell(put, ops=ops, conns=conns),
            "GET": await run_cell(get, ops=ops, conns=conns),
            "HEAD": await run_cell(head, ops=ops * 10, conns=conns),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=96)
    ap.add_argument("--size-mib", type=float, default=2.0)
    ap.add_argument("--conns", type=int, nargs="+", default=[8, 32])
    args = ap.parse_args()
    body = os.urandom(int(args.size_mib * 1024 * 1024))
    with tempfile.TemporaryDirectory() as tmp:
        gw = Gateway(Path(tmp) / "data", env={"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "false"}).start()
        try:
            print(f"{args.ops} x {args.size_mib} MiB PUT/GET, {args.ops * 10} HEAD; gateway {gw.url}")
            print(
                f"{'op':5} {'conns':>5} {'httpx ops/s':>12} {'aiohttp ops/s':>14} {'MB/s httpx':>11} "
                f"{'MB/s aiohttp':>13} {'aiohttp/httpx':>14}"
            )
            for conns in args.conns:
                hx = asyncio.run(bench_httpx(gw.url, body, ops=args.ops, conns=conns))
                ah = asyncio.run(bench_aiohttp(gw.url, body, ops=args.ops, conns=conns))
                for op in ("PUT", "GET", "HEAD"):
                    n = args.ops * (10 if op == "HEAD" else 1)
                    mb = 0.0 if op == "HEAD" else n * len(body) / 1e6
                    print(
                        f"{op:5} {conns:>5} {n / hx[op]:>12.1f} {n / ah[op]:>14.1f} {mb / hx[op]:>11.1f} "
                        f"{mb / ah[op]:>13.1f} {hx[op] / ah[op]:>14.2f}"
                    )
        finally:
            gw.stop()


if __name__ == "__main__":
    main()
