"""Cross-TP store: one object written as 4 rank parts (Content-Range PUTs) against the same bytes as one PUT.

    .venv/bin/python -m benchmarks.gateway.parts_put [--count 96] [-c 16] [--ranks 4] [--rounds 3]

One gateway (filesystem, block fsync off), an aiohttp client; 2 MiB objects, every key new. A round writes
``--count`` objects as whole PUTs, then ``--count`` other objects as ``--ranks`` parts each (the parts of one
object go up at once, as the ranks of one TP group would), and checks a GET of each. The figure is the ratio of
the two rates within a round (client and server share this machine's cores).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.gateway.compare import cpu_ticks
from benchmarks.harness import key_for
from contract.wire import PART_DIGEST_HEADER
from loopback.gateway import Gateway

MiB = 1024 * 1024


async def put_whole(s: aiohttp.ClientSession, key: str, data: bytes) -> None:
    async with s.put(f"/v1/blocks/{key}", data=data) as r:
        if r.status != 201:
            raise SystemExit(f"PUT {key}: {r.status} {await r.text()}")


async def put_parts(s: aiohttp.ClientSession, key: str, data: bytes, ranks: int) -> None:
    step = len(data) // ranks

    async def one(i: int) -> None:
        lo, hi = i * step, len(data) if i == ranks - 1 else (i + 1) * step
        part = data[lo:hi]
        headers = {
            "Content-Range": f"bytes {lo}-{hi - 1}/{len(data)}",
            PART_DIGEST_HEADER: hashlib.sha256(part).hexdigest(),
        }
        async with s.put(f"/v1/blocks/{key}", data=part, headers=headers) as r:
            if r.status not in (201, 202):
                raise SystemExit(f"PUT part {i} of {key}: {r.status} {await r.text()}")

    await asyncio.gather(*(one(i) for i in range(ranks)))


async def rate(url: str, work: list[tuple[str, bytes]], *, concurrency: int, ranks: int) -> float:
    queue = list(reversed(work))
    async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=concurrency * ranks)) as s:

        async def worker() -> None:
            while queue:
                key, data = queue.pop()
                if ranks == 1:
                    await put_whole(s, key, data)
                else:
                    await put_parts(s, key, data, ranks)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        took = time.perf_counter() - began
        for key, data in work:  # every object is whole and right
            async with s.get(f"/v1/blocks/{key}") as r:
                if r.status != 200 or await r.read() != data:
                    raise SystemExit(f"GET {key}: {r.status}")
    return sum(len(d) for _, d in work) / took / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=96)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=2 * MiB)
    args = ap.parse_args()
    env = {"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "false", "KVGATE_LOG_LEVEL": "warning"}
    whole: list[float] = []
    parts: list[float] = []
    cpu: dict[int, list[float]] = {1: [], args.ranks: []}
    client: dict[int, list[float]] = {1: [], args.ranks: []}
    with tempfile.TemporaryDirectory(prefix="kvgate-parts-") as tmp:
        gw = Gateway(Path(tmp) / "data", env=env).start()
        try:
            n = 0
            for _ in range(args.rounds):
                for out, ranks in ((whole, 1), (parts, args.ranks)):
                    work = [(key_for(n + i), os.urandom(args.size)) for i in range(args.count)]
                    n += args.count
                    pids = [gw.proc.pid] if gw.proc else []
                    before, mine = cpu_ticks(pids), time.process_time()
                    out.append(asyncio.run(rate(gw.url, work, concurrency=args.concurrency, ranks=ranks)))
                    used = (cpu_ticks(pids) - before) / os.sysconf("SC_CLK_TCK")
                    cpu[ranks].append(1000 * used / args.count)  # with the GET that checks each object
                    client[ranks].append(1000 * (time.process_time() - mine) / args.count)
        finally:
            gw.stop()
    w, p = statistics.median(whole), statistics.median(parts)
    print(
        f"{args.size // MiB} MiB objects, {args.count} per cell, concurrency {args.concurrency}, {args.rounds} rounds"
    )
    print(f"one PUT each        {w:8.1f} MB/s   rounds {[round(x) for x in whole]}")
    print(f"{args.ranks} part PUTs each   {p:8.1f} MB/s   rounds {[round(x) for x in parts]}")
    print(f"ratio parts/whole   {p / w:8.2f}")
    cw, cp = statistics.median(cpu[1]), statistics.median(cpu[args.ranks])
    print(f"server CPU ms per object (its PUTs and one checking GET): one PUT {cw:.1f}, {args.ranks} parts {cp:.1f}")
    kw, kp = statistics.median(client[1]), statistics.median(client[args.ranks])
    print(f"client CPU ms per object (this process, the same requests):  one PUT {kw:.1f}, {args.ranks} parts {kp:.1f}")


if __name__ == "__main__":
    main()
