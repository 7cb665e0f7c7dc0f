"""A TCP proxy in front of a real gateway: a slow link, or a gateway that stops answering mid-load.

Requests pass as they are. Answers (gateway -> client) are shared out over every connection as one link:
- ``rate_bytes_s``: at most that many bytes a second, in total (a congested link, an overloaded store);
- ``pass_bytes``: the first that many bytes of answers pass, then every byte is held (the connections stay open
  and silent: a stalled gateway, as a client sees one).
Both may be changed while the proxy runs. Not a mode of the product: it lives in loopback/, beside the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

CHUNK = 16 * 1024


class Proxy:
    def __init__(self, *, upstream_port: int, rate_bytes_s: float | None = None, pass_bytes: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.rate_bytes_s = rate_bytes_s
        self.pass_bytes = pass_bytes
        self.passed = 0
        """Bytes of answers passed so far."""
        self._free_at = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-proxy", daemon=True)
        self._thread.start()
        self._stop = asyncio.run_coroutine_threadsafe(self._make_event(), self._loop).result(10)
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop
        ).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    async def _make_event() -> asyncio.Event:
        return asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer, answers=False)),
            asyncio.ensure_future(self._pump(up_reader, writer, answers=True)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, answers: bool) -> None:
        while data := await src.read(CHUNK):
            if answers:
                data = await self._shape(data)
            dst.write(data)
            await dst.drain()
            if answers and self.pass_bytes is not None and self.passed >= self.pass_bytes:
                await self._stop.wait()  # stalled: hold every later byte until the proxy closes
                return

    async def _shape(self, data: bytes) -> bytes:
        if self.pass_bytes is not None:
            data = data[: max(0, self.pass_bytes - self.passed)]
        if self.rate_bytes_s is not None and data:
            now = self._loop.time()
            self._free_at = max(now, self._free_at) + len(data) / self.rate_bytes_s
            await asyncio.sleep(self._free_at - now)
        self.passed += len(data)
        return data

    def close(self) -> None:
        async def shutdown() -> None:
            self._stop.set()
            self._server.close()
            for w in list(self._writers):
                w.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@contextlib.contextmanager
def proxy(*, upstream_port: int, rate_bytes_s: float | None = None, pass_bytes: int | None = None) -> Iterator[Proxy]:
    p = Proxy(upstream_port=upstream_port, rate_bytes_s=rate_bytes_s, pass_bytes=pass_bytes)
    try:
        yield p
    finally:
        p.close()
