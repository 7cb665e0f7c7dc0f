"""BlockPayload: a PUT body goes out as the caller's buffer, after the request head and never joined with it, and
the request on the wire is byte for byte what aiohttp's own BytesPayload sends."""

from __future__ import annotations

import array
import asyncio
from typing import Any

import aiohttp
import pytest

from connector.http.body import BlockPayload
from tests.conftest import random_bytes

DATA = random_bytes(300_000, seed=11)


def _kinds() -> dict[str, Any]:
    floats = array.array("f")
    floats.frombytes(DATA[: len(DATA) // 4 * 4])
    return {
        "bytes": DATA,
        "bytearray": bytearray(DATA),
        "memoryview": memoryview(DATA),
        "float items": memoryview(floats),
        "2-D": memoryview(DATA).cast("B", (100, len(DATA) // 100)),
    }


class _Recorder:
    """The writer side aiohttp hands a payload: what it was asked to write, in order."""

    def __init__(self) -> None:
        self.writes: list[Any] = []

    async def write(self, chunk: Any) -> None:
        self.writes.append(chunk)


@pytest.mark.parametrize("kind", list(_kinds()))
def test_the_head_goes_alone_and_the_body_is_not_copied(kind: str) -> None:
    value = _kinds()[kind]
    writer = _Recorder()
    asyncio.run(BlockPayload(value).write_with_length(writer, None))  # type: ignore[arg-type]
    assert len(writer.writes) == 2 and writer.writes[0] == b""  # an empty chunk: aiohttp sends the head alone
    body = writer.writes[1]
    assert isinstance(body, memoryview) and body.format == "B" and body.ndim == 1
    assert body.obj is (value.obj if isinstance(value, memoryview) else value)  # a view of the caller's buffer
    assert body.tobytes() == bytes(memoryview(value).cast("B"))
    cut = asyncio.run(_cut(value, 1000))
    assert cut == bytes(memoryview(value).cast("B"))[:1000]


async def _cut(value: Any, length: int) -> bytes:
    writer = _Recorder()
    await BlockPayload(value).write_with_length(writer, length)  # type: ignore[arg-type]
    return bytes(writer.writes[-1])


async def _captured(payload: aiohttp.payload.Payload) -> bytes:
    """The raw request an aiohttp session sends with ``payload`` as a PUT's body, as a server receives it."""
    got = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(v) for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k.lower() == b"content-length"
        )
        got.set_result(head + await reader.readexactly(length))
        writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, aiohttp.ClientSession() as session:
        headers = {"Content-Type": "application/octet-stream", "Host": "kvgate.test"}
        async with session.put(f"http://127.0.0.1:{port}/v1/blocks/x", data=payload, headers=headers) as r:
            assert r.status == 201
        return await asyncio.wait_for(got, 10)


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.parametrize("kind", list(_kinds()))
def test_the_same_request_on_the_wire(kind: str) -> None:
    value = _kinds()[kind]
    ours = asyncio.run(_captured(BlockPayload(value)))
    theirs = asyncio.run(_captured(aiohttp.BytesPayload(value)))
    assert ours == theirs
    assert ours.endswith(bytes(memoryview(value).cast("B")))
