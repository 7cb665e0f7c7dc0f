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
import re

from tests.tcp_faults import FaultProxy, pump_both

_UNTYPED_REQUESTS = {80877103, 80877104}  # SSLRequest, GSSENCRequest: the start-up message still follows
_READY = b"Z\x00\x00\x00\x05"


class PgFaultProxy(FaultProxy):
    """Listens on ``port`` and forwards to PostgreSQL on ``upstream_port``; ``lose_rate`` (0..1) is the share of
    COMMITs whose reply is lost (changed at any time). ``commits`` and ``lost`` count what it saw and did."""

    name = "pg-fault-proxy"

    def __init__(self, *, upstream_port: int, seed: int = 0) -> None:
        super().__init__(upstream_port=upstream_port, seed=seed)
        self.lose_rate = 0.0
        self.down_after_loss = False
        """After a lost reply, the server is unreachable (``down``) until ``heal``: the change's read back fails."""
        self.hold_s = 0.0
        """The reply to each COMMIT is held this long before it is passed on (the server has committed meanwhile)."""
        self.lose_only: re.Pattern[bytes] | None = None
        """When set, only the COMMIT of a transaction one of whose statements matches it may lose its reply (e.g. the
        transactions that write a block's row, not a staging intent's)."""
        self.commits = 0
        self.lost = 0

    def url_for(self, url: str) -> str:
        """``url`` (a SQLAlchemy URL of a database on the upstream server) through this proxy."""
        return url.replace(f":{self.upstream_port}/", f":{self.port}/", 1)

    def heal(self) -> None:
        super().heal()
        self.hold_s = 0.0

    def _lose_this_one(self) -> bool:
        self.commits += 1
        if self._rng.random() < self.lose_rate:
            self.lost += 1
            return True
        return False

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

        await pump_both(client_to_server(), server_to_client(), cut=(client_w, server_w))

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
