"""The floor under kvgate's HEAD and small PUT: server CPU per request of a bare ASGI app on the same server stack.

    .venv/bin/python -m benchmarks.primitives.http_floor [--requests 6000] [-c 16] [--rounds 3] [--put-kib 64]

Runs uvicorn (uvloop, httptools: what ``kvgate serve`` runs) with an ASGI app that does the least each request
needs, drives it from an aiohttp client in this process, and reads the server's CPU clock around each round, as
``benchmarks/gateway/cost.py`` does for kvgate and nginx: a HEAD is answered with a fixed 200 and two headers; a PUT's
body is read and written as nginx's WebDAV writes it (a new file with ``O_EXCL``, one ``writev`` of the received chunks,
a rename over the key's file), with no checksum, no index and no middleware. Whatever kvgate spends above these
figures is its own (checksums, the index, stamps and locks, middleware, routing); the figures themselves are the
HTTP server's, in Python, and the kernel's file work, which nginx does in C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

from benchmarks.gateway.cost import cpu_seconds, prime_page_cache

APP = """
import os

HEADERS = [(b"etag", b'"crc64nvme:0123456789abcdef"'), (b"content-length", b"65536")]
ROOT = os.environ["FLOOR_ROOT"]
COUNT = [0]


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["method"] == "PUT":
        pieces = []
        more = True
        while more:
            message = await receive()
            pieces.append(message.get("body", b""))
            more = message.get("more_body", False)
        COUNT[0] += 1
        final = f"{ROOT}/{scope['path'].rsplit('/', 1)[1]}"
        temp = f"{ROOT}/.tmp-{COUNT[0]}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.writev(fd, pieces)
        finally:
            os.close(fd)
        os.rename(temp, final)
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": b""})
"""


RAW = """
import asyncio
import os
import sys

import httptools
import uvloop

ROOT = os.environ["FLOOR_ROOT"]
HEAD = b'HTTP/1.1 200 OK\\r\\netag: "crc64nvme:0123456789abcdef"\\r\\ncontent-length: 65536\\r\\n\\r\\n'
CREATED = b"HTTP/1.1 201 Created\\r\\ncontent-length: 0\\r\\n\\r\\n"
COUNT = [0]


class Block(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.pieces = []

    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self):
        self.pieces = []

    def on_url(self, url):
        self.url = url

    def on_body(self, body):
        self.pieces.append(body)

    def on_message_complete(self):
        if self.parser.get_method() != b"PUT":
            self.transport.write(HEAD)
            return
        COUNT[0] += 1
        final = f"{ROOT}/{self.url.decode().rsplit('/', 1)[1]}"
        temp = f"{ROOT}/.tmp-{COUNT[0]}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.writev(fd, self.pieces)
        finally:
            os.close(fd)
        os.rename(temp, final)
        self.transport.write(CREATED)


async def main():
    server = await asyncio.get_running_loop().create_server(Block, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()


uvloop.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def drive(url: str, n: int, concurrency: int, body: bytes | None = None, first: int = 0) -> None:
    todo = iter(range(first, first + n))
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            for i in todo:
                if body is not None:
                    async with session.put(f"{url}{i}", data=body) as r:
                        if r.status != 201:
                            raise RuntimeError(f"PUT answered {r.status}")
                    continue
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
    ap.add_argument("--put-kib", type=int, default=64, help="PUT body size (0: no PUT phase)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgate-floor-") as work:
        (Path(work) / "bare_app.py").write_text(APP)
        (Path(work) / "raw_server.py").write_text(RAW)
        for name, argv in (
            ("bare uvicorn (ASGI)", [sys.executable, "-m", "uvicorn", "bare_app:app", "--loop", "uvloop", "--http",
                                     "httptools", "--log-level", "warning", "--no-access-log", "--port"]),
            ("raw httptools protocol", [sys.executable, "raw_server.py"]),
        ):  # fmt: skip
            measure(name, argv, work=Path(work), args=args)


def measure(name: str, argv: list[str], *, work: Path, args: argparse.Namespace) -> None:
    port = free_port()
    root = work / f"blocks-{port}"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(work), "FLOOR_ROOT": str(root)}
    proc = subprocess.Popen([*argv, str(port)], cwd=work, env=env)
    try:
        url = f"http://127.0.0.1:{port}/v1/blocks/x"
        asyncio.run(wait_ready(url))
        asyncio.run(drive(url, 1000, args.concurrency))  # warm-up
        body = os.urandom(args.put_kib * 1024)
        puts = max(16, args.requests // 2)
        for rnd in range(args.rounds):
            before = cpu_seconds([proc.pid])
            asyncio.run(drive(url, args.requests, args.concurrency))
            used = cpu_seconds([proc.pid]) - before
            line = f"{name}, round {rnd + 1}: HEAD {1000 * used / args.requests:.3f} ms"
            if args.put_kib:
                prime_page_cache(root, nbytes=puts * len(body))
                before = cpu_seconds([proc.pid])
                asyncio.run(drive(url, puts, args.concurrency, body=body, first=rnd * puts))
                used = cpu_seconds([proc.pid]) - before
                line += f", PUT {args.put_kib} KiB {1000 * used / puts:.3f} ms"
            print(line + " server CPU per request", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
