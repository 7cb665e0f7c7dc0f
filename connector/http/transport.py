"""The client's transports: two peers behind one small interface (``Transport``), each answering a ``Call`` with a
``Reply``.

- ``LeanPool`` (connector/http/http1.py): block PUTs and GETs on keep-alive HTTP/1.1 connections of its own, a
  fraction of aiohttp's CPU per request; it carries only what goes on the wire as it is (a block's path, a raw body).
- ``SessionTransport`` (here): aiohttp, which carries every call (JSON bodies, HEAD, paths that need quoting, a base
  URL with a path, proxies), and so is the last one the client asks.

``BlockClient`` (connector/http/client.py) sends each call on the first transport that carries it, and keeps what
is common to both above them: retries, the circuit, stats, integrity checks. A transport raises ``ConnectionError``
(or aiohttp's connection errors) and ``TimeoutError``, which the client's one retry loop handles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from connector.http import body

Buffer = bytes | bytearray | memoryview

Target = Callable[[int], memoryview | None]
"""Where the body of an answer of a given status goes: a caller's buffer (then the reply's body is how many bytes
arrived, -1 once they outgrow it), or None (collected as bytes)."""


@dataclass(frozen=True, slots=True)
class Call:
    """One request, as the client asks it of a transport."""

    method: str
    path: str
    headers: Mapping[str, str] = field(default_factory=dict)
    data: Buffer | None = None
    """A block's body, sent as the caller's buffer (never copied into another)."""
    json: Any = None
    """A JSON document to send (aiohttp only)."""
    timeout_s: float | None = None
    """The whole request's limit; None: the transport's own (the client's configured timeouts)."""
    target_for: Target | None = None
    """Where an answer's body goes, by status; None: collected as bytes (a HEAD's answer has none)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A transport's answer, whatever its status (retrying is the client's call)."""

    status: int
    headers: Mapping[str, str]
    """Case-insensitive (a ``CIMultiDict``, from either transport)."""
    body: bytes | int
    """The body's bytes; or, where ``Call.target_for`` gave it a buffer, how many arrived (-1: more than it holds)."""

    def text(self, limit: int = 300) -> str:
        """The start of an error's body, for a message."""
        return self.body[:limit].decode(errors="replace") if isinstance(self.body, bytes) else ""


class Transport(Protocol):
    def carries(self, call: Call) -> bool:
        """Whether this transport can send ``call`` as it is."""
        ...

    async def send(self, call: Call) -> Reply:
        """``call`` once, no retry: its reply, or ConnectionError / TimeoutError (aiohttp's errors on aiohttp)."""
        ...

    async def close(self) -> None: ...


class SessionTransport:
    """Every call, on an aiohttp session (its connector's pool, TLS and timeouts: connector/http/client.py)."""

    def __init__(self, session: aiohttp.ClientSession, *, connect_timeout_s: float) -> None:
        self.session = session
        self.connect_timeout_s = connect_timeout_s

    def carries(self, call: Call) -> bool:
        return True

    async def send(self, call: Call) -> Reply:
        kw: dict[str, Any] = {"headers": call.headers}
        if call.data is not None:
            kw["data"] = body.BlockPayload(call.data)
        if call.json is not None:
            kw["json"] = call.json
        # No per-call timeout: leave the argument out, so the session's timeouts apply (None would disable them).
        if call.timeout_s is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=call.timeout_s, sock_connect=self.connect_timeout_s)
        async with self.session.request(call.method, call.path, **kw) as resp:
            target = call.target_for(resp.status) if call.target_for is not None else None
            got: bytes | int
            if call.method == "HEAD":
                got = b""
            elif target is not None:
                got = await body.read_into(resp, target)
            else:
                got = await body.read_all(resp)
            return Reply(resp.status, resp.headers, got)

    async def close(self) -> None:
        await self.session.close()
