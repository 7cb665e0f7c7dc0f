"""2 MiB block PUT/GET throughput: through the gateway on its S3 backend vs aioboto3 straight to the same server.

One run starts a moto S3 server and a gateway (S3 backend on that server, SQLite index) on loopback, then times
rounds of ``--blocks`` PUTs and GETs at ``--concurrency`` each way, alternating direct and gateway, and prints
MB/s with the gateway/direct ratio (best round of each). Every GET's bytes are checked against what was written.

    .venv/bin/python benchmarks/s3_vs_direct.py --blocks 64 --concurrency 8 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aioboto3
import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gateway import Gateway
from tests.services import S3_CREDS, MotoServer

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


async def run(*, blocks: int, size: int, concurrency: int, rounds: int) -> None:
    payloads = [hashlib.sha256(str(i).encode()).digest() * (size // 32) for i in range(blocks)]
    payloads = [bytes((b + i) % 256 for b in p[:64]) + p[64:] for i, p in enumerate(payloads)]
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        moto = MotoServer(log_dir=Path(tmp)).start()
        gw = Gateway(Path(tmp) / "data", env=moto.backend_env(bucket="bench-gw"))
        try:
            gw.start(timeout_s=60)
            session = aioboto3.Session()
            async with (
                session.client(
                    "s3",
                    endpoint_url=moto.url,
                    region_name=S3_CREDS["region"],
                    aws_access_key_id=S3_CREDS["access_key_id"],
                    aws_secret_access_key=S3_CREDS["secret_access_key"],
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

                best: dict[tuple[str, str], float] = {}
                for rnd in range(rounds):
                    for way, put, get in (("direct", d_put, d_get), ("gateway", g_put, g_get)):
                        if rnd > 0 and way == "gateway":  # a re-put of identical bytes is a no-op: delete first
                            for i in range(blocks):
                                async with http.delete(f"/v1/blocks/{block_key(i)}") as r:
                                    r.raise_for_status()
                        for op, fn in (("PUT", put), ("GET", get)):
                            secs = await timed(blocks, concurrency, fn)
                            mbps = blocks * size / MB / secs
                            best[(way, op)] = max(best.get((way, op), 0.0), mbps)
                        if got[way] != payloads:
                            raise RuntimeError(f"{way}: bytes read back differ from bytes written")
        finally:
            gw.stop()
            moto.stop()
    print(
        f"\n{blocks} blocks x {size / 2**20:.0f} MiB, concurrency {concurrency}, best of {rounds} rounds, "
        f"moto server on loopback\n"
    )
    print(f"{'op':<5}{'direct aioboto3 MB/s':>22}{'gateway (S3) MB/s':>20}{'gateway/direct':>16}")
    for op in ("PUT", "GET"):
        d, g = best[("direct", op)], best[("gateway", op)]
        print(f"{op:<5}{d:>22.1f}{g:>20.1f}{g / d:>16.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--size-mib", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    asyncio.run(run(blocks=a.blocks, size=a.size_mib * 2**20, concurrency=a.concurrency, rounds=a.rounds))


if __name__ == "__main__":
    main()
