"""A fault proxy in front of PostgreSQL, for tests: it forwards both ways, and on demand it loses the reply to a
COMMIT: the client's COMMIT goes to the server, the server commits and answers, and the proxy then closes both
sockets instead of passing the answer on. The client sees its connection drop with the outcome unknown, exactly
what a network cut after COMMIT does.

kvgate reaches PostgreSQL through asyncpg, which sends a transaction's COMMIT as a simple Query message
(``Q``, text ``COMMIT;``); the proxy reads the client's stream message by message (the untyped start-up
messages first, then ``type, int32 length, body``) to find them. The server's stream is forwarded as it comes, but
after a COMMIT whose reply is to be lost, where it is read up to its ReadyForQuery (``Z``) and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import threading

from tests.gateway import free_port

_UNTYPED_REQUESTS = {80877103, 80877104}  # SSLRequest, GSSENCRequest: the start-up message still follows
_READY = b"Z\x00\x00\x00\x05"


class PgFaultProxy:
    """Listens on ``port`` and forwards to PostgreSQL on ``upstream_port``; ``lose_rate`` (0..1) is the share of
    COMMITs whose reply is lost (changed at any time). ``commits`` and ``lost`` count what it saw and did."""

    def __init__(self, *, upstream_port: int, seed: int = 0) -> None:
        self.port = free_port()
        self.upstream_port = upstream_port
        self.lose_rate = 0.0
        self.down_after_loss = False
        """After a lost reply, the server is unreachable (``down``) until ``heal``: the change's read back fails."""
        self.down = False
        self.hold_s = 0.0
        """The reply to each COMMIT is held this long before it is passed on (the server has committed meanwhile)."""
        self.lose_only: re.Pattern[bytes] | None = None
        """When set, only the COMMIT of a transaction one of whose statements matches it may lose its reply (e.g. the
        transactions that write a block's row, not a staging intent's)."""
        self.commits = 0
        self.lost = 0
        self._open: set[asyncio.Task[None]] = set()
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pg-fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def url_for(self, url: str) -> str:
        """``url`` (a SQLAlchemy URL of a database on the upstream server) through this proxy."""
        return url.replace(f":{self.upstream_port}/", f":{self.port}/", 1)

    def start(self) -> PgFaultProxy:
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

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    def heal(self) -> None:
        self.down = False
        self.hold_s = 0.0
        """The reply to each COMMIT is held this long before it is passed on (the server has committed meanwhile)."""

    def cut(self) -> None:
        """A partition: every open connection is cut, and new ones are refused until ``heal``."""
        self._loop.call_soon_threadsafe(self._went_down)

    def _lose_this_one(self) -> bool:
        self.commits += 1
        if self._rng.random() < self.lose_rate:
            self.lost += 1
            return True
        return False

    def _went_down(self) -> None:
        """The reply was lost and the server is now out of reach: every open connection is cut."""
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
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        losing = asyncio.Event()
        holding = asyncio.Event()

        async def client_to_server() -> None:
            typed = False
            matched = False
            prepared: dict[bytes, bool] = {}  # a prepared statement's name: whether its text matches ``lose_only``
            while True:
                if typed:
                    kind = await client_r.readexactly(1)
                else:
                    kind = b""
                head = await client_r.readexactly(4)
                body = await client_r.readexactly(int.from_bytes(head, "big") - 4)
                if not typed:
                    typed = int.from_bytes(body[:4], "big") not in _UNTYPED_REQUESTS
                elif _is_commit(kind, body):
                    if (self.lose_only is None or matched) and self._lose_this_one():
                        losing.set()
                    elif self.hold_s > 0:
                        holding.set()
                    matched = False
                elif self.lose_only is not None:
                    matched = matched or self._matches(kind, body, prepared)
                server_w.write(kind + head + body)
                await server_w.drain()

        async def server_to_client() -> None:
            held = b""
            while data := await server_r.read(65536):
                if losing.is_set():
                    held += data
                    if _READY in held:  # the server has answered the COMMIT: cut both sockets, the answer goes nowhere
                        if self.down_after_loss:
                            self._went_down()
                        return
                    continue
                if holding.is_set():
                    await asyncio.sleep(self.hold_s)
                    holding.clear()
                client_w.write(data)
                await client_w.drain()

        tasks = [asyncio.create_task(client_to_server()), asyncio.create_task(server_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in (client_w, server_w):
                with contextlib.suppress(Exception):
                    writer.transport.abort()

    def _matches(self, kind: bytes, body: bytes, prepared: dict[bytes, bool]) -> bool:
        """Whether this message runs a statement whose text matches ``lose_only``: a simple Query, or a Bind of a
        statement prepared (Parse: name, text) on this connection earlier (asyncpg caches them)."""
        assert self.lose_only is not None
        if kind == b"Q":
            return self.lose_only.search(body) is not None
        if kind == b"P":
            name, _, rest = body.partition(b"\0")
            prepared[name] = hit = self.lose_only.search(rest.partition(b"\0")[0]) is not None
            return hit
        if kind == b"B":
            return prepared.get(body.partition(b"\0")[2].partition(b"\0")[0], False)
        return False


def _is_commit(kind: bytes, body: bytes) -> bool:
    """A simple Query message whose text is COMMIT (asyncpg's ``COMMIT;``)."""
    return kind == b"Q" and body.rstrip(b"\0").strip().rstrip(b";").strip().upper() == b"COMMIT"
