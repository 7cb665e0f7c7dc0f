"""The floor under kvgate's HEAD: server CPU per request of a bare ASGI app on the same server stack.

    .venv/bin/python -m benchmarks.http_floor [--requests 6000] [-c 16] [--rounds 3]

Runs uvicorn (uvloop, httptools: what ``kvgate serve`` runs) with an ASGI app that answers every request with a
fixed 200 and two headers and does nothing else, drives HEADs at it from an aiohttp client in this process, and
reads the server's CPU clock around each round, as ``benchmarks/cost.py`` does for kvgate and nginx. Whatever kvgate
spends on a HEAD above this figure is its own (middleware, routing, the metadata cache); this figure itself is the
HTTP server's, in Python, which nginx's C answers in a fraction of.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

APP = """
HEADERS = [(b"etag", b'"crc64nvme:0123456789abcdef"'), (b"content-length", b"65536")]


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": b""})
"""


def cpu_seconds(pid: int) -> float:
    return time.clock_gettime(((~pid) << 3) | 2)  # the process's CPU clock: every thread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def drive(url: str, n: int, concurrency: int) -> None:
    todo = iter(range(n))
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            for _ in todo:
                async with session.head(url) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HEAD answered {r.status}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def wait_ready(url: str) -> None:
    for _ in range(100):
        try:
            await drive(url, 1, 1)
            return
        except aiohttp.ClientError:
            await asyncio.sleep(0.1)
    raise RuntimeError("the bare server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgate-floor-") as work:
        (Path(work) / "bare_app.py").write_text(APP)
        port = free_port()
        argv = [sys.executable, "-m", "uvicorn", "bare_app:app", "--port", str(port), "--loop", "uvloop",
                "--http", "httptools", "--log-level", "warning", "--no-access-log"]  # fmt: skip
        proc = subprocess.Popen(argv, cwd=work, env={**os.environ, "PYTHONPATH": work})
        try:
            url = f"http://127.0.0.1:{port}/v1/blocks/x"
            asyncio.run(wait_ready(url))
            asyncio.run(drive(url, 1000, args.concurrency))  # warm-up
            for rnd in range(args.rounds):
                before = cpu_seconds(proc.pid)
                asyncio.run(drive(url, args.requests, args.concurrency))
                used = cpu_seconds(proc.pid) - before
                print(f"round {rnd + 1}: bare uvicorn HEAD {1000 * used / args.requests:.3f} ms server CPU per request")
        finally:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
