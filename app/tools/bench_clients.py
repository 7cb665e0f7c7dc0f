"""The HTTP clients ``kvgate bench`` can drive: aiohttp (default) and httpx, behind one small interface.

GET bodies are hashed chunk by chunk as they arrive (no joined copy of the body), so verifying costs one sha256.
"""

from __future__ import annotations

import hashlib
import ssl
from typing import Any, Protocol

from contract.wire import BLOCK_META_HEADER


class Client(Protocol):
    async def put(self, url: str, body: memoryview, *, meta: str | None = None) -> int:
        """``meta``: an X-KVGate-Block-Meta value, as the connectors send one."""

    async def get(self, url: str) -> tuple[int, int, str]:
        """(status, body length, hex sha256 of the body)."""

    async def head(self, url: str) -> tuple[int, int | None]:
        """(status, Content-Length)."""

    async def lookup(self, url: str, keys: list[str]) -> int: ...

    async def aclose(self) -> None: ...


class AiohttpClient:
    def __init__(self, *, base_url: str, concurrency: int, timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(
            base_url=base_url,
            connector=aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, ssl=tls or True),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )

    async def put(self, url: str, body: memoryview, *, meta: str | None = None) -> int:
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(body))}
        if meta is not None:
            headers[BLOCK_META_HEADER] = meta
        async with self._session.put(url, data=body, headers=headers) as r:
            await r.read()
            return r.status

    async def get(self, url: str) -> tuple[int, int, str]:
        async with self._session.get(url) as r:
            h = hashlib.sha256()
            n = 0
            async for chunk in r.content.iter_any():
                h.update(chunk)
                n += len(chunk)
            return r.status, n, h.hexdigest()

    async def head(self, url: str) -> tuple[int, int | None]:
        async with self._session.head(url) as r:
            length = r.headers.get("Content-Length")
            return r.status, int(length) if length is not None else None

    async def lookup(self, url: str, keys: list[str]) -> int:
        async with self._session.post(url, json={"keys": keys}) as r:
            await r.read()
            return r.status

    async def aclose(self) -> None:
        await self._session.close()


class HttpxClient:
    def __init__(self, *, base_url: str, concurrency: int, timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        import httpx

        self._client = httpx.AsyncClient(
            base_url=base_url,
            verify=tls or True,
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            timeout=timeout_s,
        )

    async def put(self, url: str, body: memoryview, *, meta: str | None = None) -> int:
        headers = {"Content-Type": "application/octet-stream"}
        if meta is not None:
            headers[BLOCK_META_HEADER] = meta
        r = await self._client.put(url, content=bytes(body), headers=headers)
        return r.status_code

    async def get(self, url: str) -> tuple[int, int, str]:
        async with self._client.stream("GET", url) as r:
            h = hashlib.sha256()
            n = 0
            async for chunk in r.aiter_raw():
                h.update(chunk)
                n += len(chunk)
            return r.status_code, n, h.hexdigest()

    async def head(self, url: str) -> tuple[int, int | None]:
        r = await self._client.head(url)
        length = r.headers.get("Content-Length")
        return r.status_code, int(length) if length is not None else None

    async def lookup(self, url: str, keys: list[str]) -> int:
        r = await self._client.post(url, json={"keys": keys})
        return r.status_code

    async def aclose(self) -> None:
        await self._client.aclose()


def make_client(name: str, **kw: Any) -> Client:
    if name == "httpx":
        return HttpxClient(**kw)
    return AiohttpClient(**kw)
