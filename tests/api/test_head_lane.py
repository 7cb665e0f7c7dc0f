"""The HEAD lane (app/api/server/lanes.py) answers byte for byte what the full ASGI stack answers.

Two real servers (``create_server``, uvicorn on loopback, in threads of this process) hold the same blocks, one with
the lane and one without (``head_lane=False``). The same raw HTTP/1.1 bytes go to both, over sockets: single
requests, pipelined ones, HTTP/1.0, ``Connection: close``, percent-encoded paths, misses, bad keys, callers with
and without the right token. Every answer must be the same bytes (less the ``date`` line), the lane must have
answered the ones it can (and only those), and the request metrics and hit counters must come out equal.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from app.api.server.lanes import HeadLane
from app.api.server.runner import GatewayServer
from tests.conftest import key_for, random_bytes, sha
from tests.security.conftest import TOKENS, tokens_json
from tests.unit.inprocess import served_server, settings_for

K1, K2, MISSING = key_for(1), key_for(2), key_for(3)
BODY1, BODY2, BODY3 = random_bytes(5000, seed=1), random_bytes(70_000, seed=2), random_bytes(10, seed=3)


def _lane(server: GatewayServer) -> HeadLane | None:
    lane: HeadLane | None = getattr(server.server.config.http, "head_lane", None)
    return lane


def _read_answers(sock: socket.socket, methods: list[str]) -> list[bytes]:
    """One answer per request sent (a HEAD's has no body whatever its Content-Length says), ``date`` lines dropped;
    stops early if the server closes the connection."""
    buf = b""
    answers = []
    for method in methods:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return answers
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b": ")
            if name.lower() == b"content-length" and method != "HEAD":
                length = int(value)
        while len(buf) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
        body, buf = buf[:length], buf[length:]
        kept = [line for line in lines if not line.lower().startswith(b"date:")]
        answers.append(b"\r\n".join(kept) + b"\r\n\r\n" + body)
    return answers


def _exchange(url: str, requests: list[tuple[str, bytes]]) -> tuple[list[bytes], bool]:
    """Send every request in one write on one connection; the answers, and whether the server then closed it."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"".join(raw for _, raw in requests))
        answers = _read_answers(sock, [method for method, _ in requests])
        sock.settimeout(0.3)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
    return answers, closed


def _req(method: str, target: str, *headers: str, version: str = "1.1") -> tuple[str, bytes]:
    lines = [f"{method} {target} HTTP/{version}", "Host: kvgate.test", *headers]
    return method, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _head(key: str, *headers: str, version: str = "1.1") -> tuple[str, bytes]:
    return _req("HEAD", f"/v1/blocks/{key}", *headers, version=version)


@contextlib.contextmanager
def _pair(
    tmp_path: Path, *, lane: str = "head_lane", **fields: Any
) -> Iterator[tuple[tuple[str, GatewayServer], tuple[str, GatewayServer]]]:
    """Two servers on the fs store: with ``lane`` (a setting, and the protocol's attribute of that name) and without."""
    with (
        served_server(settings_for(tmp_path / "lane", fs=True, **fields)) as on,
        served_server(settings_for(tmp_path / "stack", fs=True, **{lane: False}, **fields)) as off,
    ):
        assert getattr(on[1].server.config.http, lane, None) is not None
        assert getattr(off[1].server.config.http, lane, None) is None
        yield on, off


def _put_blocks(url: str, headers: dict[str, str] | None = None) -> None:
    with httpx.Client(base_url=url, headers=headers) as c:
        assert c.put(f"/v1/blocks/{K1}", content=BODY1).status_code == 201
        assert c.put(f"/v1/blocks/{K2}", content=BODY2, headers={"X-KVGate-SHA256": sha(BODY2)}).status_code == 201


def _request_samples(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """kvgate_requests_total of the block routes, and the hit and miss counters."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
    out = {}
    for line in text.splitlines():
        if line.startswith(("kvgate_requests_total{", "kvgate_hits_total", "kvgate_misses_total")) and (
            "/metrics" not in line
        ):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_the_lane_answers_as_the_full_stack(tmp_path: Path) -> None:
    pct = K1.replace("_g0/", "%5Fg0/")  # uvicorn decodes the path: the same key
    cases: list[tuple[str, list[tuple[str, bytes]], int]] = [
        # (what, requests sent in one write, at least this many answered by the lane)
        ("cached block", [_head(K1)], 1),
        ("block stored with a sha256", [_head(K2)], 1),
        ("miss", [_head(MISSING)], 0),
        ("bad key", [_head("not-a-key")], 0),
        ("percent-encoded path", [_head(pct)], 1),
        ("query string", [_req("HEAD", f"/v1/blocks/{K1}?x=1")], 0),
        ("declared body", [_head(K1, "Content-Length: 0")], 0),
        ("HTTP/1.0", [_head(K1, version="1.0")], 1),
        ("Connection: close, then another request", [_head(K1, "Connection: close"), _head(K2)], 1),
        ("pipelined", [_head(K1), _req("GET", f"/v1/blocks/{K1}"), _head(K2), _head(MISSING), _head(K1)], 1),
        ("pipelined behind a GET", [_req("GET", f"/v1/blocks/{K2}"), _head(K1)], 0),
        ("GET is not the lane's", [_req("GET", f"/v1/blocks/{K1}")], 0),
        ("keep-alive: several in turn", [_head(K1), _head(K2), _head(K1)], 1),
    ]
    with _pair(tmp_path) as ((lane_url, lane_server), (stack_url, _)):
        _put_blocks(lane_url)
        _put_blocks(stack_url)
        lane = _lane(lane_server)
        assert lane is not None
        check_cases(lane, lane_url, stack_url, cases)
        # changes are seen at once: an overwrite's new ETag, a deletion's 404
        for url in (lane_url, stack_url):
            with httpx.Client(base_url=url) as c:
                assert c.put(f"/v1/blocks/{K1}", content=BODY3).status_code in (200, 201)
                assert c.delete(f"/v1/blocks/{K2}").status_code == 204
        overwritten, deleted = _exchange(lane_url, [_head(K1)]), _exchange(lane_url, [_head(K2)])
        assert overwritten == _exchange(stack_url, [_head(K1)])
        assert deleted == _exchange(stack_url, [_head(K2)])
        assert b"content-length: 10\r\n" in overwritten[0][0] and deleted[0][0].startswith(b"HTTP/1.1 404 ")
        assert _request_samples(lane_url) == _request_samples(stack_url)
        assert lane.served >= 10


def check_cases(
    lane: Any, lane_url: str, stack_url: str, cases: list[tuple[str, list[tuple[str, bytes]], int]]
) -> None:
    """Each case's requests, sent in one write to both servers: the same answers and the same close, an answer for
    each request (the first only after a ``Connection: close``), at least as many answered by the lane as the case
    says, and none when it says none of a lone request."""
    for what, requests, at_least in cases:
        before = lane.served
        got, got_closed = _exchange(lane_url, requests)
        want, want_closed = _exchange(stack_url, requests)
        assert got == want, what
        assert got_closed == want_closed, what
        assert len(got) == (1 if "Connection: close" in what else len(requests)), what
        assert lane.served - before >= at_least, what
        if at_least == 0 and len(requests) == 1:
            assert lane.served == before, what  # a request it must not answer went to the stack


def test_the_lane_applies_auth_as_the_stack(tmp_path: Path) -> None:
    with _pair(tmp_path, tokens=json.loads(tokens_json())) as servers:
        check_auth_as_the_stack(servers, put_blocks=_put_blocks, lane_of=_lane, request=lambda *h: _head(K1, *h))


def check_auth_as_the_stack(
    servers: tuple[tuple[str, GatewayServer], tuple[str, GatewayServer]],
    *,
    put_blocks: Callable[[str, dict[str, str]], None],
    lane_of: Callable[[GatewayServer], Any],
    request: Callable[..., tuple[str, bytes]],
) -> None:
    """Six callers and a bad token ask both servers ``request(*auth header)``: the same answers (401/403/200 as the
    stack's auth decides), the lane answering exactly the allowed ones, the same request metrics."""
    (lane_url, lane_server), (stack_url, _) = servers
    writer = {"Authorization": f"Bearer {TOKENS['write']}"}
    put_blocks(lane_url, writer)
    put_blocks(stack_url, writer)
    lane = lane_of(lane_server)
    assert lane is not None
    statuses = {}
    for name in [None, "read", "write", "admin", "other", "scoped_admin", "bad"]:
        auth = [] if name is None else [f"Authorization: Bearer {TOKENS.get(name, 'not-a-token')}"]
        before = lane.served
        got, _ = _exchange(lane_url, [request(*auth)])
        want, _ = _exchange(stack_url, [request(*auth)])
        assert got == want, name
        statuses[name] = int(got[0].split(b" ")[1])
        assert lane.served - before == (1 if statuses[name] == 200 else 0), name
    assert statuses == {
        None: 401, "read": 200, "write": 200, "admin": 200, "other": 403, "scoped_admin": 200, "bad": 401
    }  # fmt: skip
    admin = {"Authorization": f"Bearer {TOKENS['admin']}"}
    assert _request_samples(lane_url, admin) == _request_samples(stack_url, admin)


def test_no_lane_under_a_root_path(tmp_path: Path) -> None:
    """Under a root path (a proxy's prefix) the stack strips the prefix and auth reads the path without it: the
    lane leaves those requests to the stack."""
    with served_server(settings_for(tmp_path, fs=True, root_path="/kv")) as (url, server):
        _put_blocks(url)
        lane = _lane(server)
        assert lane is not None
        answers, _ = _exchange(url, [_head(K1)])
        assert answers[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert lane.served == 0


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``seconds``)."""
    began = time.monotonic()
    sock.settimeout(seconds)
    try:
        return time.monotonic() - began if sock.recv(1) == b"" else None
    except TimeoutError:
        return None


def test_keep_alive_after_the_lanes_answers(tmp_path: Path) -> None:
    """The lane's answers leave the connection to uvicorn's keep-alive timeout, as the stack's do: an idle
    connection is closed once it has been idle that long, one kept busy by the lane's answers is not, and a stack
    answer after a lane answer starts its own idle time."""
    with served_server(settings_for(tmp_path, fs=True)) as (url, server):
        _put_blocks(url)
        lane = _lane(server)
        assert lane is not None
        server.server.config.timeout_keep_alive = 1  # read by each new connection's protocol
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as busy:
            began = time.monotonic()
            while time.monotonic() - began < 2.5:  # past two idle timeouts, never idle for one
                busy.sendall(_head(K1)[1])
                assert _read_answers(busy, ["HEAD"])[0].startswith(b"HTTP/1.1 200 ")
                time.sleep(0.2)
            waited = _closed_within(busy, 5.0)
            assert waited is not None and 0.5 <= waited <= 2.0, waited  # then idle: closed after ~1 s
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as mixed:
            mixed.sendall(_head(K1)[1])
            assert _read_answers(mixed, ["HEAD"])[0].startswith(b"HTTP/1.1 200 ")
            time.sleep(0.7)
            mixed.sendall(_req("GET", f"/v1/blocks/{K1}", "Range: bytes=0-9")[1])  # the stack's: uvicorn's timer
            assert _read_answers(mixed, ["GET"])[0].startswith(b"HTTP/1.1 206 ")
            assert _closed_within(mixed, 0.6) is None  # past the lane's first deadline: still open
            mixed.sendall(_head(K2)[1])
            assert _read_answers(mixed, ["HEAD"])[0].startswith(b"HTTP/1.1 200 ")
            waited = _closed_within(mixed, 5.0)
            assert waited is not None and 0.5 <= waited <= 2.0, waited
        assert lane.served >= 10
