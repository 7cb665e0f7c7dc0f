"""Limits: uploads in flight (429), slow bodies (408), slow or huge headers (408/431), body caps (413), bind guard."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for, random_bytes
from tests.gateway import REPO, Gateway, free_port

ENV = {
    "KVGATE_MAX_UPLOADS_IN_FLIGHT": "2",
    "KVGATE_BODY_MIN_RATE_BYTES_S": "2000",
    "KVGATE_BODY_GRACE_S": "1",
    "KVGATE_BODY_IDLE_TIMEOUT_S": "2",
    "KVGATE_HEADER_TIMEOUT_S": "2",
    "KVGATE_MAX_HEADER_BYTES": "16384",
    "KVGATE_MAX_JSON_BODY_BYTES": "20000",
    "KVGATE_IO_CHUNK_BYTES": "4096",  # an upload in flight makes its temp file early
}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = Gateway(tmp_path_factory.mktemp("limits") / "data", env=ENV).start()
    yield gateway
    gateway.stop()


def put_head(key: str, length: int) -> bytes:
    return f"PUT /v1/blocks/{key} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


def read_response(s: socket.socket, *, timeout_s: float = 15.0) -> bytes:
    s.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        try:
            piece = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not piece:
            break
        data += piece
    return data


def temp_files(gw: Gateway) -> list[Path]:
    return list((gw.data_dir / "blocks").rglob(".kvgate-tmp-*"))


def wait_until(cond: object, *, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_uploads_past_the_bound_get_429_at_once(gw: Gateway) -> None:
    held = []
    try:
        for i in range(2):
            s = socket.create_connection(("127.0.0.1", gw.port))
            # over the PUT lane's 4 MiB (app/api/server/put_lane.py): the stack reads it at once, in several reads,
            # and the store writes the first batches to a temp file while the rest is awaited
            s.sendall(put_head(key_for(100 + i), 5_000_000) + b"x" * 600_000)
            held.append(s)
        # both are in the handler, reading their bodies: each has its temp file
        assert wait_until(lambda: len(temp_files(gw)) == 2), temp_files(gw)
        r = httpx.put(f"{gw.url}/v1/blocks/{key_for(102)}", content=b"y" * 100, timeout=5)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_requests"
        assert httpx.get(f"{gw.url}/v1/blocks/{key_for(102)}").status_code == 404
    finally:
        for s in held:
            s.close()
    # the slots come back once those clients are gone
    assert wait_until(lambda: httpx.put(f"{gw.url}/v1/blocks/{key_for(102)}", content=b"y" * 100).status_code == 201)
    assert wait_until(lambda: not temp_files(gw))


def test_slow_body_is_cut_off_with_408_and_others_are_served(gw: Gateway) -> None:
    key = key_for(200)
    s = socket.create_connection(("127.0.0.1", gw.port))
    try:
        s.sendall(put_head(key, 100_000))
        start = time.monotonic()
        served = 0
        while time.monotonic() - start < 8:  # a trickle: 20 B/s, far under the 2000 B/s minimum
            try:
                s.sendall(b"z" * 10)
            except OSError:
                break
            # meanwhile another client is served normally
            data = random_bytes(5000, served)
            other = key_for(300 + served)
            assert httpx.put(f"{gw.url}/v1/blocks/{other}", content=data, timeout=5).status_code == 201
            assert httpx.get(f"{gw.url}/v1/blocks/{other}", timeout=5).content == data
            served += 1
            time.sleep(0.5)
        reply = read_response(s)
    finally:
        s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"request_timeout"' in reply
    assert served >= 2
    assert httpx.head(f"{gw.url}/v1/blocks/{key}").status_code == 404
    assert wait_until(lambda: not temp_files(gw))


def test_stalled_body_is_cut_off(gw: Gateway) -> None:
    key = key_for(201)
    with socket.create_connection(("127.0.0.1", gw.port)) as s:
        s.sendall(put_head(key, 50_000) + b"a" * 20_000)  # fast start, then nothing
        reply = read_response(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert httpx.head(f"{gw.url}/v1/blocks/{key}").status_code == 404
    assert wait_until(lambda: not temp_files(gw))


def test_slowloris_headers_time_out_and_others_are_served(gw: Gateway) -> None:
    socks = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(20)]
    try:
        for s in socks:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        alive = set(range(len(socks)))
        for i in range(8):  # one header line every 0.5 s: the 2 s header deadline passes meanwhile
            for n in sorted(alive):
                try:
                    socks[n].sendall(f"X-Slow-{i}: a\r\n".encode())
                except OSError:
                    alive.discard(n)  # the server hung up on it
            assert httpx.get(f"{gw.url}/healthz", timeout=5).status_code == 200
            time.sleep(0.5)
        assert not alive
        replies = [read_response(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert all(r.startswith(b"HTTP/1.1 408") for r in replies), replies[0][:200]


def test_silent_connection_is_closed(gw: Gateway) -> None:
    with socket.create_connection(("127.0.0.1", gw.port)) as s:
        s.settimeout(15)
        assert s.recv(100) == b""  # closed by the server after header_timeout_s, nothing sent


def test_header_size_bound_with_httptools(gw: Gateway) -> None:
    with socket.create_connection(("127.0.0.1", gw.port)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Ok: " + b"a" * 8000 + b"\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200")
    for size in (20_000, 2_000_000):
        with socket.create_connection(("127.0.0.1", gw.port)) as s:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
            reply = read_response(s)
        assert reply.startswith(b"HTTP/1.1 431"), (size, reply[:200])
    assert httpx.get(f"{gw.url}/healthz").status_code == 200


def test_json_body_caps(gw: Gateway) -> None:
    big = {"keys": [key_for(i) for i in range(400)]}  # ~ 40 KB, over the 20 KB cap
    r = httpx.post(f"{gw.url}/v1/lookup", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap is counted as it streams
        yield b'{"keys": ['
        for i in range(400):
            yield f'"{key_for(i)}",'.encode()
        yield b'"x"]}'

    r = httpx.post(f"{gw.url}/v1/lookup", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.post(f"{gw.url}/v1/lookup", json={"keys": [key_for(1)]}).status_code == 200


def test_non_loopback_bind_without_tokens_refuses_to_start(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVGATE_DATA_DIR": str(tmp_path / "d")}
    env.pop("KVGATE_TOKENS", None)
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        proc = subprocess.run(
            [sys.executable, "-m", "app", "serve", "--host", host, "--port", str(free_port())],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode != 0, host
        assert "refusing to listen" in proc.stderr and "KVGATE_TOKENS" in proc.stderr, proc.stderr
