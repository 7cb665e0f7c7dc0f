"""The server ``kvgate serve`` runs, built by ``create_server`` and run in this process: the same protocol pieces."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx

from tests.conftest import key_for, random_bytes, sha
from tests.inprocess.harness import served, settings_for


def test_the_served_stack_is_the_one_serve_runs(tmp_path: Path) -> None:
    data = random_bytes(8192, 7)
    with served(settings_for(tmp_path, max_header_bytes=4096)) as url, httpx.Client(base_url=url) as c:
        put = c.put(f"/v1/blocks/{key_for(1)}", content=data, headers={"X-KVGate-SHA256": sha(data)})
        assert put.status_code == 201, put.text
        got = c.get(f"/v1/blocks/{key_for(1)}")
        assert got.status_code == 200 and got.content == data
        # the request head's bound is the server's protocol (app/api/server/head_limits.py), not a middleware
        big = c.get("/healthz", headers={"X-Filler": "a" * 8192})
        assert big.status_code == 431 and big.json()["error"]["code"] == "headers_too_large"
        # and so is the JSON answer to a request uvicorn cannot parse
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"]["code"] == "invalid_request"


def _read_head(sock: socket.socket) -> bytes:
    """One whole answer's head, its body read off the socket too (by its Content-Length): the next read starts at
    the next answer, however the server's writes were cut into segments."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            return answer
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")[1:]
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    assert len(body) == length, (head, body)  # one answer per request: nothing read past it
    return head + b"\r\n\r\n" + body


def test_the_head_deadline_holds_on_a_kept_alive_connection(tmp_path: Path) -> None:
    """The head timer is made once per connection and re-armed for the deadline in force when it fires
    (app/api/server/head_limits.py): heads that each arrive in time are never cut, however long the connection
    lives, and a head that stalls later on the same connection still gets its 408 at its own deadline."""
    settings = settings_for(tmp_path, header_timeout_s=1.0)
    with served(settings) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            began = time.monotonic()
            while time.monotonic() - began < 2.5:  # past two deadlines of the first head: no cut
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_head(sock).startswith(b"HTTP/1.1 200 "), "a head that arrived in time was cut"
                time.sleep(0.1)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            stalled = time.monotonic()
            answer = _read_head(sock)
            waited = time.monotonic() - stalled
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert 0.9 <= waited < 5.0, waited
