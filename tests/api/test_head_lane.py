"""The HEAD lane (app/api/server/lanes.py) answers byte for byte what the full ASGI stack answers.

Two real servers (``create_server``, uvicorn on loopback, in threads of this process) hold the same blocks, one with
the lane and one without (``head_lane=False``). The same raw HTTP/1.1 bytes go to both, over sockets: single
requests, pipelined ones, HTTP/1.0, ``Connection: close``, percent-encoded paths, misses, bad keys, callers with
and without the right token. Every answer must be the same bytes (less the ``date`` line), the lane must have
answered the ones it can (and only those), and the request metrics and hit counters must come out equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import httpx

from app.api.server.lanes import HeadLane
from app.api.server.runner import GatewayServer
from tests.conftest import key_for, random_bytes, sha
from tests.inprocess.harness import served_server, settings_for
from tests.security.conftest import TOKENS, tokens_json

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
        return answers, _closed(sock)


def _closed(sock: socket.socket) -> bool:
    """Whether the server closes the connection (within 0.3 s) after its answers."""
    sock.settimeout(0.3)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


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


def _converse(url: str, writes: list[bytes], methods: list[str], *, gap_s: float = 0.05) -> tuple[list[bytes], bool]:
    """Send each of ``writes`` on one connection as a write of its own, ``gap_s`` apart (each one read of its own
    by the server); then the answers to ``methods`` (fewer where the server sends fewer: a second's silence ends
    the reading), and whether the server closed the connection."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for data in writes:
            sock.sendall(data)
            time.sleep(gap_s)
        sock.settimeout(1.0)
        try:
            answers = _read_answers(sock, methods)
        except TimeoutError:
            answers = [b"(silence)"]
        return answers, _closed(sock)


def _raw(line: bytes, *headers: bytes) -> bytes:
    return b"\r\n".join([line, b"Host: kvgate.test", *headers]) + b"\r\n\r\n"


def test_a_read_of_one_whole_head_is_answered_before_the_parse(tmp_path: Path) -> None:
    """A read that is one whole, plain HEAD of a cached block is answered before httptools parses it (the lane's
    ``prelexed``), byte for byte as the stack; a read that is anything else, or that ends a head begun in an
    earlier read, goes to the parser as before (whatever it holds), and the stack's answers stay the same."""
    head1, head2 = f"HEAD /v1/blocks/{K1} HTTP/1.1".encode(), f"HEAD /v1/blocks/{K2} HTTP/1.1".encode()
    put4 = _req("PUT", f"/v1/blocks/{key_for(4)}", "Content-Length: 10")[1] + BODY3
    get4, after = _req("GET", f"/v1/blocks/{key_for(4)}")[1], ["HEAD", "PUT", "GET", "HEAD"]
    upgrade = ["Connection: upgrade", "Upgrade: foo"]
    cases: list[tuple[str, list[bytes], list[str], int]] = [
        # (what, each write a read of its own, the answers' methods, how many the pre-parse answers)
        ("plain", [_head(K1)[1]], ["HEAD"], 1),
        ("no header at all", [head1 + b"\r\n\r\n"], ["HEAD"], 1),
        ("blanks, HTAB, odd tokens", [_raw(head1, b"X-A:\t a b \t", b"X!#$%&'*+.^_`|~-Z: 1", b"Empty:")], ["HEAD"], 1),
        ("a header that reads like a HEAD", [_raw(head1, b"X-Note: " + head2)], ["HEAD"], 1),
        # a split head: the read that ends it is the parser's (taken alone, the second read is a HEAD of K2)
        ("a head split in two reads", [head1 + b"\r\nHost: x\r\n", b"X-A: b\r\n\r\n"], ["HEAD"], 0),
        ("a header's value split", [_req("GET", f"/v1/blocks/{K1}")[1][:-2] + b"X-A: ", _raw(head2)], ["GET"], 0),
        ("pipelined in one read", [_head(K1)[1] + _head(K2)[1]], ["HEAD", "HEAD"], 0),
        ("a GET behind it in one read", [_head(K1)[1] + _req("GET", f"/v1/blocks/{K1}")[1]], ["HEAD", "GET"], 0),
        ("keep-alive: then a PUT, a GET, a HEAD", [_head(K1)[1], put4, get4, _head(key_for(4))[1]], after, 2),
        ("Connection: close", [_head(K1, "Connection: close")[1], _head(K2)[1]], ["HEAD", "HEAD"], 0),
        ("Connection: keep-alive", [_head(K1, "Connection: keep-alive")[1]], ["HEAD"], 0),
        ("HTTP/1.0", [_head(K1, version="1.0")[1]], ["HEAD"], 0),
        ("Transfer-Encoding", [_head(K1, "Transfer-Encoding: chunked")[1], b"0\r\n\r\n"], ["HEAD", "HEAD"], 0),
        ("Upgrade alone: no upgrade", [_head(K1, "Upgrade: foo")[1]], ["HEAD"], 1),
        ("content-length", [_head(K1, "content-length: 0")[1]], ["HEAD"], 0),
        ("Expect", [_head(K1, "Expect: 100-continue")[1]], ["HEAD"], 0),
        ("Upgrade, then a HEAD", [_head(K1, *upgrade)[1], _head(K1)[1]], ["HEAD", "HEAD"], 1),  # httptools resumes
        ("NUL in a value", [_raw(head1, b"X-A: a\x00b")], ["HEAD"], 0),
        ("a control in a value", [_raw(head1, b"X-A: a\x01b")], ["HEAD"], 0),
        ("obs-text in a value", [_raw(head1, b"X-A: caf\xe9")], ["HEAD"], 0),
        ("bare LF", [head1 + b"\r\nHost: x\nX-A: b\r\n\r\n"], ["HEAD"], 0),
        ("obs-fold", [_raw(head1, b"X-A: a", b" b")], ["HEAD"], 0),
        ("a blank before the colon", [_raw(head1, b"X-A : b")], ["HEAD"], 0),
        ("an empty header name", [_raw(head1, b": b")], ["HEAD"], 0),
        ("a lowercase method", [_raw(b"head" + head1[4:])], ["HEAD"], 0),
        ("a byte past ASCII in the path", [_raw(head1.replace(b".bin", b"\xff.bin"))], ["HEAD"], 0),
        ("percent-encoded path", [_head(K1.replace("_g0/", "%5Fg0/"))[1]], ["HEAD"], 0),
        ("query string", [_req("HEAD", f"/v1/blocks/{K1}?x=1")[1]], ["HEAD"], 0),
        ("fragment", [_req("HEAD", f"/v1/blocks/{K1}#x")[1]], ["HEAD"], 0),
        ("a miss", [_head(MISSING)[1]], ["HEAD"], 0),
        ("a CRLF before the request", [b"\r\n" + _head(K1)[1]], ["HEAD"], 0),
    ]
    with _pair(tmp_path) as ((lane_url, lane_server), (stack_url, stack_server)):
        _put_blocks(lane_url)
        _put_blocks(stack_url)
        lane = _lane(lane_server)
        assert lane is not None
        for what, writes, methods, prelexed in cases:
            before = lane.prelexed
            got = _converse(lane_url, writes, methods)
            assert got == _converse(stack_url, writes, methods), what
            assert lane.prelexed - before == prelexed, what
        assert _request_samples(lane_url) == _request_samples(stack_url)
        counted = [s.server.server_state.total_requests for s in (lane_server, stack_server)]
        assert counted[0] == counted[1], counted


def test_after_an_upgrade_the_next_read_is_a_request(tmp_path: Path) -> None:
    """A request that asks for an upgrade uvicorn does not make is answered; httptools resumes its parser after it
    (what followed it in its read is dropped), so the next read is a new request, for the pre-parse as for the
    stack."""
    upgrade = _req("GET", "/healthz", "Connection: upgrade", "Upgrade: foo")[1]
    with _pair(tmp_path) as ((lane_url, lane_server), (stack_url, _)):
        _put_blocks(lane_url)
        _put_blocks(stack_url)
        lane = _lane(lane_server)
        assert lane is not None
        for writes, prelexed in (([upgrade, _head(K1)[1]], 1), ([upgrade + _head(K2)[1], _head(K1)[1]], 1)):
            got = _converse(lane_url, writes, ["GET", "HEAD"])
            assert got == _converse(stack_url, writes, ["GET", "HEAD"])
            assert len(got[0]) == 2 and got[0][0].startswith(b"HTTP/1.1 200 ")
            assert lane.prelexed == prelexed
            lane.prelexed = 0


def test_the_pre_parse_applies_auth_as_the_stack(tmp_path: Path) -> None:
    """The Authorization line the pre-parse reads is the one the stack's auth reads: the first, less its blanks."""
    read, bad = TOKENS["read"], "not-a-token"
    cases = [
        (f"Authorization: Bearer {read}", 200, 1),
        (f"authorization:  \tBearer {read} \t", 200, 1),
        (f"Authorization: Bearer {bad}\r\nAuthorization: Bearer {read}", 401, 0),
        (f"Authorization: Bearer {read}\r\nAuthorization: Bearer {bad}", 200, 1),
        (f"X-Authorization: Bearer {read}", 401, 0),
        (f"Authorization: Bearer {TOKENS['other']}", 403, 0),
    ]
    with _pair(tmp_path, tokens=json.loads(tokens_json())) as ((lane_url, lane_server), (stack_url, _)):
        writer = {"Authorization": f"Bearer {TOKENS['write']}"}
        _put_blocks(lane_url, writer)
        _put_blocks(stack_url, writer)
        lane = _lane(lane_server)
        assert lane is not None
        for header, status, prelexed in cases:
            before = lane.prelexed
            got = _converse(lane_url, [_head(K1, header)[1]], ["HEAD"])
            assert got == _converse(stack_url, [_head(K1, header)[1]], ["HEAD"]), header
            assert got[0][0].startswith(b"HTTP/1.1 %d " % status), header
            assert lane.prelexed - before == prelexed, header


def test_the_head_bounds_hold_for_the_pre_parse(tmp_path: Path) -> None:
    """A head over ``max_header_bytes`` in one read is the bounds' 431, not the pre-parse's 200; heads the
    pre-parse answers are each counted alone, not summed along the connection."""
    with served_server(settings_for(tmp_path, fs=True, max_header_bytes=400)) as (url, server):
        _put_blocks(url)
        lane = _lane(server)
        assert lane is not None
        answers, _ = _converse(url, [_head(K1, "X-Filler: " + "a" * 300)[1]], ["HEAD"])
        assert answers[0].startswith(b"HTTP/1.1 431 "), answers
        assert lane.served == 0
        heads = [_head(K1, "X-Filler: " + "a" * 150)[1]] * 6  # 6 x 300 bytes on one connection
        answers, closed = _converse(url, heads, ["HEAD"] * 6)
        assert [a[:13] for a in answers] == [b"HTTP/1.1 200 "] * 6 and not closed
        assert lane.prelexed == 6


def test_the_pre_parse_waits_its_turn(tmp_path: Path) -> None:
    """A HEAD read while an earlier request of the connection is still being answered waits behind it (uvicorn's
    pipeline), and one read while the client is not reading waits for the client, as the stack's answers do."""
    with _pair(tmp_path) as ((lane_url, lane_server), (stack_url, stack_server)):
        for server in (lane_server, stack_server):
            app = server.server.config.loaded_app

            async def slow(scope: Any, receive: Any, send: Any, app: Any = app) -> None:
                if scope["type"] == "http" and scope["path"] == "/slow":
                    await asyncio.sleep(0.3)
                await app(scope, receive, send)

            server.server.config.loaded_app = slow  # read by each new connection's protocol
        _put_blocks(lane_url)
        _put_blocks(stack_url)
        lane = _lane(lane_server)
        assert lane is not None
        writes = [_req("GET", "/slow")[1], _head(K1)[1]]
        got = _converse(lane_url, writes, ["GET", "HEAD"])
        assert got == _converse(stack_url, writes, ["GET", "HEAD"])
        assert got[0][0].startswith(b"HTTP/1.1 404 ") and got[0][1].startswith(b"HTTP/1.1 200 ")
        assert lane.prelexed == 0
        big = random_bytes(3 * 1024 * 1024, seed=4)
        with httpx.Client(base_url=lane_url) as c:
            assert c.put(f"/v1/blocks/{key_for(4)}", content=big).status_code == 201
        parts = urlsplit(lane_url)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.settimeout(10)
            sock.connect((parts.hostname, parts.port))
            gets, state = 0, cast(Any, lane_server.server.server_state)
            while not any(p.flow.write_paused for p in state.connections):
                assert gets < 8, "the server's writes never paused"
                sock.sendall(_req("GET", f"/v1/blocks/{key_for(4)}")[1])  # until the socket's buffers are full
                gets += 1
                time.sleep(0.2)
            sock.sendall(_head(K1)[1])
            time.sleep(0.3)
            assert lane.prelexed == 0 and lane.served == 0
            answers = _read_answers(sock, ["GET"] * gets + ["HEAD"])
        assert all(a.endswith(big) for a in answers[:gets]) and answers[gets].startswith(b"HTTP/1.1 200 ")


def test_no_pre_parse_past_the_concurrency_limit(tmp_path: Path) -> None:
    """Past uvicorn's concurrency limit the answer is uvicorn's 503, lane or not."""
    with _pair(tmp_path, limit_concurrency=2) as ((lane_url, lane_server), (stack_url, _)):
        _put_blocks(lane_url)
        _put_blocks(stack_url)
        lane = _lane(lane_server)
        assert lane is not None
        got = []
        for url in (lane_url, stack_url):
            parts = urlsplit(url)
            with socket.create_connection((parts.hostname, parts.port), timeout=10):  # a second connection
                time.sleep(0.1)
                got.append(_converse(url, [_head(K1)[1]], ["HEAD"]))
        assert got[0] == got[1] and got[0][0][0].startswith(b"HTTP/1.1 503 "), got
        assert lane.served == 0
