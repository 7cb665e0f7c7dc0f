"""The lean PUT pool (connector/http/http1.py) through BlockClient: the request on the wire, keep-alive connections and
what happens when one breaks, timeouts, the connection limit; against a scripted raw HTTP server on loopback (each
request answered by the next action of its script) and a real gateway."""

from __future__ import annotations

import array
import asyncio
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from connector.http.checksums import checksum
from connector.http.client import BlockClient, ClientConfig, GatewayUnavailable
from connector.http.http1 import _Connection
from tests.conftest import key_for, random_bytes
from tests.gateway import REPO, Gateway

OK = b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\nx-kvgate-note: stored\r\n\r\n"


@dataclass
class RawServer:
    """A loopback HTTP/1.1 server that reads each request (head, Content-Length body) and acts on it by its script:

    ``ok`` answers 201 and keeps the connection; ``drop`` closes it without an answer (a gateway whose keep-alive
    timeout ran out as the request arrived); ``cut`` sends part of the answer, then closes; ``drip`` sends the
    answer a byte at a time; ``silent`` never answers (it waits for the client to close); ``hold`` answers after
    0.1 s; ``extra`` answers with a second, unasked answer behind it; a list of bytes is sent piece by piece, a
    few milliseconds apart, and the connection kept."""

    script: list[str | list[bytes]] = field(default_factory=list)
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)
    connections: int = 0
    open: int = 0
    peak: int = 0
    url: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = [line.partition(b":") for line in head.split(b"\r\n")[1:]]
                length = next((int(v) for k, _, v in lines if k.lower() == b"content-length"), 0)
                self.requests.append((head, await reader.readexactly(length)))
                action = self.script.pop(0) if self.script else "ok"
                if isinstance(action, list):  # these pieces, a moment apart, as the answer
                    for piece in action:
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.005)
                    continue
                if action in ("drop", "cut"):
                    writer.write(OK[:20] if action == "cut" else b"")
                    await writer.drain()
                    return
                if action == "silent":
                    await reader.read()  # until the client gives up on the connection
                    return
                if action == "hold":
                    await asyncio.sleep(0.1)
                if action == "drip":
                    for i in range(len(OK)):
                        writer.write(OK[i : i + 1])
                        await writer.drain()
                        await asyncio.sleep(0.001)
                else:
                    writer.write(OK + (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n" if action == "extra" else b""))
                await writer.drain()
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
def raw() -> Iterator[RawServer]:
    server = RawServer()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> asyncio.Server:
        srv = await asyncio.start_server(server.serve, "127.0.0.1", 0)
        server.url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        return srv

    async def stop() -> None:
        srv.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    srv = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def client(url: str, **kw: float) -> BlockClient:
    cfg = {"retries": 2, "backoff_s": 0.001, "down_cooldown_s": 0.0, **kw}
    return BlockClient(ClientConfig(base_url=url, **cfg))  # type: ignore[arg-type]


DATA = random_bytes(300_000, seed=5)


def test_the_request_on_the_wire(raw: RawServer) -> None:
    floats = array.array("f")
    floats.frombytes(DATA)
    with client(raw.url) as bc:
        assert bc.run(bc.put(key_for(1), memoryview(floats), meta="m1"))
        assert bc.run(bc.put(key_for(2), memoryview(DATA).cast("B", (100, 3000)), create_only=True))
    (head1, body1), (head2, body2) = raw.requests
    assert body1 == DATA and body2 == DATA  # a tensor's memory (float items, 2-D) goes as its bytes
    lines = head1.decode("latin-1").split("\r\n")
    assert lines[0] == f"PUT /v1/blocks/{key_for(1)} HTTP/1.1"
    port = raw.url.rsplit(":", 1)[1]
    got = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    assert got["host"] == f"127.0.0.1:{port}"
    assert got["content-length"] == str(len(DATA))
    assert got["content-type"] == "application/octet-stream"
    assert got["x-kvgate-checksum"] == checksum(DATA).header
    assert got["x-kvgate-block-meta"] == "m1"
    assert b"\r\nIf-None-Match: *\r\n" in head2
    assert raw.connections == 1  # kept alive between the two


@pytest.mark.parametrize(
    "takes",
    [
        pytest.param(None, id="all"),
        pytest.param(0, id="would-block"),
        pytest.param(10, id="part-of-the-head"),
        pytest.param(-1, id="head-and-part-of-the-body"),
    ],
)
def test_head_and_body_go_in_one_writev_and_any_rest_through_the_transport(
    raw: RawServer, monkeypatch: pytest.MonkeyPatch, takes: int | None
) -> None:
    """On a plain connection a PUT's head and body leave in one ``writev`` (no copy, one segment), the body the
    caller's buffer itself; what the socket does not take goes through the transport, in order: the server gets the
    same bytes whatever the socket took."""
    import os

    real = os.writev  # (connector.http.http1.os is the os module: patched for everyone while the test runs)
    calls: list[tuple[int, ...]] = []

    def writev(fd: int, buffers: tuple[bytes, memoryview]) -> int:
        calls.append(tuple(memoryview(b).nbytes for b in buffers))
        head, body = buffers
        if takes is None:
            return real(fd, buffers)
        if takes == 0:
            raise BlockingIOError
        if takes > 0:
            return os.write(fd, head[:takes])
        return real(fd, (head, body[: len(body) // 3]))

    monkeypatch.setattr("connector.http.http1.os.writev", writev)
    with client(raw.url) as bc:
        for i in range(3):
            assert bc.run(bc.put(key_for(i), DATA))
        assert bc.stats.retries == 0
    assert [body for _, body in raw.requests] == [DATA] * 3
    assert [h.split(b" ")[1] for h, _ in raw.requests] == [f"/v1/blocks/{key_for(i)}".encode() for i in range(3)]
    assert len(calls) == 3 and all(sizes[1] == len(DATA) for sizes in calls)
    assert raw.connections == 1


def test_an_answer_in_many_reads(raw: RawServer) -> None:
    raw.script = ["drip", "drip"]
    with client(raw.url) as bc:
        assert bc.run(bc.put(key_for(1), DATA))
        assert bc.run(bc.put(key_for(2), DATA))
        assert bc.stats.retries == 0 and bc.stats.puts == 2
    assert raw.connections == 1


def test_a_kept_connection_the_gateway_closed_is_replaced_at_once(raw: RawServer) -> None:
    raw.script = ["ok", "drop"]
    with client(raw.url) as bc:
        assert bc.run(bc.put(key_for(1), DATA))
        assert bc.run(bc.put(key_for(2), DATA))
        assert bc.stats.retries == 0  # sent again on a fresh connection, no backoff, not a retry
    assert [h.split(b" ")[1] for h, _ in raw.requests][1:] == [f"/v1/blocks/{key_for(2)}".encode()] * 2
    assert raw.connections == 2


def test_a_fresh_connection_closed_without_an_answer_is_retried_with_backoff(raw: RawServer) -> None:
    raw.script = ["drop", "ok"]
    with client(raw.url) as bc:
        assert bc.run(bc.put(key_for(1), DATA))
        assert bc.stats.retries == 1  # never at once on a connection just made: a gateway that drops every PUT
    raw.script = ["drop"] * 3
    with client(raw.url) as bc, pytest.raises(GatewayUnavailable, match="ended before the answer"):
        bc.run(bc.put(key_for(2), DATA))


def test_an_answer_cut_short_on_a_kept_connection_is_a_retry(raw: RawServer) -> None:
    raw.script = ["ok", "cut", "ok"]
    with client(raw.url) as bc:
        assert bc.run(bc.put(key_for(1), DATA))
        assert bc.run(bc.put(key_for(2), DATA))
        assert bc.stats.retries == 1  # the gateway had begun to answer: not taken for a stale connection


def test_bytes_no_request_asked_for_end_the_connection(raw: RawServer) -> None:
    raw.script = ["extra", "ok", "ok"]
    with client(raw.url) as bc:
        assert bc.run(bc.put(key_for(1), DATA))
        assert bc.run(bc.put(key_for(2), DATA))
        assert bc.run(bc.put(key_for(3), DATA))
        assert bc.stats.retries == 0
    assert raw.connections == 2  # the first connection was dropped, never read as the second PUT's answer


def test_no_answer_in_time_is_a_timeout_and_frees_the_connection(raw: RawServer) -> None:
    raw.script = ["silent", "silent"]
    with client(raw.url, request_timeout_s=0.3, retries=1) as bc:
        with pytest.raises(GatewayUnavailable, match="timeout"):
            bc.run(bc.put(key_for(1), DATA), timeout_s=10)
        for _ in range(200):
            if raw.open == 0:
                break
            time.sleep(0.01)
        assert raw.open == 0  # the client closed both: an answer that comes late is no one's
        assert bc.run(bc.put(key_for(2), DATA), timeout_s=10)
    assert raw.connections == 3


def test_at_most_max_connections(raw: RawServer) -> None:
    raw.script = ["hold"] * 24
    with client(raw.url, max_connections=4) as bc:

        async def all_puts() -> list[bool]:
            return await asyncio.gather(*(bc.put(key_for(i), DATA) for i in range(24)))

        assert all(bc.run(all_puts(), timeout_s=30))
    assert raw.peak == 4 and raw.connections == 4


@pytest.mark.parametrize("lean", [True, False])
def test_both_clients_store_the_same_bytes(gateway: Gateway, lean: bool) -> None:
    with client(gateway.url, lean_http=lean) as bc:
        blobs = {key_for(i): random_bytes(4096 * (i + 1), seed=i) for i in range(8)}
        for key, blob in blobs.items():
            assert bc.run(bc.put(key, blob))
        for key, blob in blobs.items():
            assert bc.run(bc.get(key)) == blob
        assert (bc._lean is not None) is lean


def test_without_httptools_every_request_goes_on_aiohttp(gateway: Gateway) -> None:
    """An engine's environment without httptools (vLLM's own server brings it) keeps a working client."""
    code = f"""
import sys
sys.modules["httptools"] = None  # import fails
from connector.http.client import BlockClient, ClientConfig
with BlockClient(ClientConfig(base_url={gateway.url!r})) as bc:
    assert bc._lean is None
    assert bc.run(bc.put({key_for(77)!r}, b"abc" * 1000))
    assert bc.run(bc.get({key_for(77)!r})) == b"abc" * 1000
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


def _answer(body: bytes, *, status: str = "200 OK", length: int | None = None, more: bytes = b"") -> bytes:
    """A gateway's answer to a GET of ``body`` (its Content-Length ``length`` if given)."""
    head = f"HTTP/1.1 {status}\r\ncontent-length: {len(body) if length is None else length}\r\n"
    return head.encode() + b"x-kvgate-checksum: " + checksum(body).header.encode() + b"\r\n" + more + b"\r\n" + body


def _pieces(data: bytes, *cuts: int) -> list[bytes]:
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def test_a_load_goes_into_the_callers_buffer_in_any_pieces(raw: RawServer) -> None:
    """The head alone, the head with a few body bytes, the body in pieces: the bytes land in the caller's buffer
    (after the head, straight from the socket) and the connection serves the next request."""
    whole = _answer(DATA)
    head_len = whole.index(b"\r\n\r\n") + 4
    raw.script = [
        [whole],
        _pieces(whole, head_len),
        _pieces(whole, 5, head_len + 10, head_len + 70_000, len(whole) - 1),
        _pieces(whole, head_len - 1),
    ]
    with client(raw.url) as bc:
        for i in range(4):
            into = bytearray(len(DATA))
            assert bc.run(bc.get_into(key_for(i), memoryview(into)), timeout_s=10)
            assert into == DATA
        assert bc.stats.retries == 0 and bc.stats.corrupt_reads == 0
    assert raw.connections == 1
    assert all(head.startswith(b"GET /v1/blocks/") and body == b"" for head, body in raw.requests)


def test_a_body_of_another_length_than_the_buffer_is_refused(raw: RawServer) -> None:
    longer, shorter = DATA + b"!", DATA[:-1]
    raw.script = [_pieces(_answer(longer), 100, 200_000), _pieces(_answer(shorter), 100), [_answer(DATA)]]
    with client(raw.url) as bc:
        into = bytearray(len(DATA))
        assert not bc.run(bc.get_into(key_for(1), memoryview(into)), timeout_s=10)
        assert not bc.run(bc.get_into(key_for(2), memoryview(into)), timeout_s=10)
        assert bc.stats.corrupt_reads == 2
        assert bc.run(bc.get_into(key_for(3), memoryview(into)), timeout_s=10) and into == DATA
    assert raw.connections == 1  # each answer read to its end: the connection stays in step


def test_a_chunked_body_and_an_error_text(raw: RawServer) -> None:
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in _pieces(DATA, 1000, 150_000)) + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-kvgate-checksum: " + checksum(DATA).header.encode()
    raw.script = [
        _pieces(head + b"\r\n\r\n" + chunked, 50, 90_000),
        [b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nnot found"],
    ]
    with client(raw.url) as bc:
        into = bytearray(len(DATA))
        assert bc.run(bc.get_into(key_for(1), memoryview(into)), timeout_s=10) and into == DATA
        assert not bc.run(bc.get_into(key_for(2), memoryview(into)), timeout_s=10)
        assert bc.stats.misses == 1 and bc.stats.corrupt_reads == 0


def test_a_connection_lost_in_the_middle_of_a_body_is_a_retry(raw: RawServer) -> None:
    whole = _answer(DATA)
    raw.script = ["ok", _pieces(whole, 5000)[:1], [whole]]  # the second request: part of the body, then nothing
    with client(raw.url, request_timeout_s=0.5) as bc:
        assert bc.run(bc.put(key_for(0), DATA))
        into = bytearray(len(DATA))
        assert bc.run(bc.get_into(key_for(1), memoryview(into)), timeout_s=10) and into == DATA
        assert bc.stats.retries == 1


def test_bytes_after_a_body_do_not_go_into_the_buffer(raw: RawServer) -> None:
    """The body is received into the caller's buffer up to its length, never past it: what follows it (here an
    answer no request asked for) is read apart, and ends the connection."""
    whole = _answer(DATA)
    into = bytearray(len(DATA) + 100)  # room past the body: nothing may land there
    raw.script = [[whole[:5000], whole[5000:] + b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"], [whole]]
    with client(raw.url) as bc:
        view = memoryview(into)[: len(DATA)]
        assert bc.run(bc.get_into(key_for(1), view), timeout_s=10)
        assert into == DATA + bytes(100)
        assert bc.run(bc.get_into(key_for(2), view), timeout_s=10)
        assert bc.stats.retries == 0
    assert raw.connections == 2


class _Sink(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def write(self, data: object) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_failed_load_writes_nothing_more_into_the_buffer() -> None:
    """Once a request has failed (a timeout, a cancel) its connection receives nothing more into the caller's
    buffer, which may already be another load's: asyncio's TLS transport hands the protocol what it decrypts while
    its close flushes, after the caller was told."""
    loop = asyncio.new_event_loop()
    try:
        conn = _Connection()
        conn.connection_made(_Sink())
        target = bytearray(100)
        conn.send(b"GET /v1/blocks/x HTTP/1.1\r\n\r\n", memoryview(b""), loop, lambda status: memoryview(target))
        head = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"a" * 10
        conn.get_buffer(-1)[: len(head)] = head
        conn.buffer_updated(len(head))
        assert target[:10] == b"a" * 10 and conn.get_buffer(-1).obj is target  # the body's rest: straight in
        conn.close()
        late = conn.get_buffer(-1)
        assert late.obj is not target
        late[:20] = b"b" * 20
        conn.buffer_updated(20)
        assert target == b"a" * 10 + bytes(90)
    finally:
        loop.close()
