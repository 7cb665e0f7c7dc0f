"""CPU per HEAD of the server's own protocol path, without sockets: the HEAD lane against the full ASGI stack.

    .venv/bin/python -m benchmarks.gateway.protocol_path [--requests 20000] [--rounds 3]

Builds the server ``kvgate serve`` runs (``create_server``: the bounded httptools protocol, the lane, the app) on a
temporary data directory, runs its lifespan, stores one block, then feeds the same ``HEAD`` request bytes straight
into one connection's protocol object (a transport that only collects what is written), ``--requests`` times, and
prints the process CPU per request. With the lane the answer is written inside ``data_received``; through the
stack (``KVGATE_HEAD_LANE=false``) each request's task runs before the next is fed (one ``await`` per request, which
the figure includes). No system calls for the socket, no client: the Python a request costs, which a real run
multiplies (the client shares the cores and the caches; ``benchmarks.gateway.cost`` gives the figure that counts).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import uvloop
from uvicorn.lifespan.on import LifespanOn
from uvicorn.server import ServerState

from app.config import Settings
from app.main import create_server
from benchmarks.harness import key_for


class CollectingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        self.closing = False

    def write(self, data: Any) -> None:
        self.written += 1

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def per_request_us(*, lane: bool, requests: int, rounds: int) -> list[float]:
    settings = Settings(data_dir=Path(tempfile.mkdtemp(prefix="kvgate-protocol-path-")), head_lane=lane)
    config = create_server(settings).server.config
    config.load()
    lifespan = LifespanOn(config)
    await lifespan.startup()
    key = key_for(1)
    try:
        transport = httpx.ASGITransport(app=config.loaded_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgate.test") as client:
            assert (await client.put(f"/v1/blocks/{key}", content=b"x" * 65536)).status_code == 201
        protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
        )
        sink = CollectingTransport()
        protocol.connection_made(sink)
        request = (
            f"HEAD /v1/blocks/{key} HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: Python/3.11 aiohttp/3.14\r\n"
            "Accept: */*\r\nAccept-Encoding: gzip, deflate\r\n\r\n"
        ).encode()
        figures = []
        for _ in range(rounds):
            began = time.process_time()
            for _ in range(requests):
                protocol.data_received(request)
                if not lane:
                    await asyncio.sleep(0)  # the request's task
            figures.append((time.process_time() - began) / requests * 1e6)
        assert sink.written >= rounds * requests, "not every request was answered"
        protocol.connection_lost(None)
        return figures
    finally:
        await lifespan.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for lane in (True, False):
        figures = uvloop.run(per_request_us(lane=lane, requests=args.requests, rounds=args.rounds))
        name = "HEAD lane" if lane else "ASGI stack"
        print(f"{name:>10}: " + ", ".join(f"{f:.1f}" for f in figures) + " us per HEAD (process CPU)")


if __name__ == "__main__":
    main()
