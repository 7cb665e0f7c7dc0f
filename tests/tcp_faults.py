"""A fault proxy for any TCP service (tests only): in front of the S3-compatible server it does to the gateway's S3
requests what a network does. It forwards both ways, and on demand:

- ``cut_request_rate`` (0..1): each piece of a request read from the client is, with that chance, the last: both
  connections are cut there, before the request or in the middle of its body (the server sees a request that
  never ends, and drops it);
- ``lose_reply_rate`` (0..1): each reply is, with that chance, lost: the request reached the server whole and was
  done there (an object stored, a delete made), and both connections are cut as its first bytes come back, so the
  client never learns the outcome;
- ``cut``/``heal``: a partition, every open connection cut and new ones refused until healed.

``cut_requests``, ``lost_replies`` and ``partitions`` count what it did. The pieces are the reads of the client's
stream (up to 64 KiB), so a cut lands anywhere in a request, at no HTTP boundary the proxy would need to know.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Coroutine
from typing import Any, Self

from tests.gateway import free_port

PIECE = 64 * 1024


async def pump_both(
    there: Coroutine[Any, Any, None], back: Coroutine[Any, Any, None], *, cut: tuple[asyncio.StreamWriter, ...]
) -> None:
    """Run both directions of a connection until either ends, then end the other and cut both sockets."""
    tasks = [asyncio.create_task(there), asyncio.create_task(back)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in cut:
            with contextlib.suppress(Exception):
                writer.transport.abort()


class FaultProxy:
    """What the fault proxies share: their own event loop on a thread, listening on ``port`` and forwarding to
    ``upstream_port`` on loopback, partitions (``cut``/``heal``: every open connection cut, new ones refused) and
    stopping. A subclass forwards one connection (``_forward``) and does its faults there."""

    name = "fault-proxy"

    def __init__(self, *, upstream_port: int, seed: int = 0) -> None:
        self.port = free_port()
        self.upstream_port = upstream_port
        self.down = False
        self.partitions = 0
        self._rng = random.Random(seed)
        self._open: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def cut(self) -> None:
        """A partition: every open connection cut, new ones refused until ``heal``."""
        self.partitions += 1
        self._loop.call_soon_threadsafe(self._went_down)

    def heal(self) -> None:
        self.down = False

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    def _went_down(self) -> None:
        """The server is out of reach from now on: every open connection is cut (on the proxy's loop)."""
        self.down = True
        for task in list(self._open):
            if task is not asyncio.current_task():
                task.cancel()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.down:
            client_w.transport.abort()
            return
        me = asyncio.current_task()
        assert me is not None
        self._open.add(me)
        try:
            await self._forward(client_r, client_w)
        except asyncio.CancelledError:  # cut (``_went_down``): a cancelled handler makes asyncio log a traceback
            client_w.transport.abort()
        finally:
            self._open.discard(me)

    async def _forward(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class TcpFaultProxy(FaultProxy):
    name = "tcp-fault-proxy"

    def __init__(self, *, upstream_port: int, seed: int = 0) -> None:
        super().__init__(upstream_port=upstream_port, seed=seed)
        self.cut_request_rate = 0.0
        self.lose_reply_rate = 0.0
        self.cut_requests = self.lost_replies = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.transport.abort()
            return
        answering = False  # the server has begun the reply to the request sent last

        async def client_to_server() -> None:
            nonlocal answering
            while data := await client_r.read(PIECE):
                answering = False
                if self._rng.random() < self.cut_request_rate:
                    self.cut_requests += 1
                    server_w.write(data[: self._rng.randrange(len(data) + 1)])  # cut anywhere inside this piece
                    await server_w.drain()
                    return
                server_w.write(data)
                await server_w.drain()

        async def server_to_client() -> None:
            nonlocal answering
            while data := await server_r.read(PIECE):
                if not answering:
                    answering = True
                    if self._rng.random() < self.lose_reply_rate:
                        self.lost_replies += 1
                        return
                client_w.write(data)
                await client_w.drain()

        await pump_both(client_to_server(), server_to_client(), cut=(client_w, server_w))
