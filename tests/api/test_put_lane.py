"""The PUT lane (app/api/server/put_lane.py) answers what the full ASGI stack answers, and stores the same bytes.

Two real servers (``create_server``, uvicorn on loopback, in threads of this process) start empty, one with the lane
and one without (``put_lane=False``). The same raw HTTP/1.1 bytes go to both, over sockets, in the same order: new
blocks, identical and changed overwrites, create-only conflicts, checksum mismatches, malformed headers, parts,
``Expect``, HTTP/1.0, ``Connection: close``, pipelined requests, bodies that come in a later read, callers with and
without the right token, a full set of upload slots. Every answer must be the same bytes (less the ``date`` line),
the lane must have taken the ones it can (and only those), and the stored bytes and the request metrics must come
out equal.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from starlette.datastructures import Headers
from starlette.requests import Request

from app.api.routes import blocks
from app.api.routes.put_answer import PUT_HEADERS
from app.api.routes.thin import _header_name
from app.api.server import lanes, put_lane
from app.api.server.lanes import BODY_WAIT_S
from app.api.server.put_lane import MAX_BODY_BYTES, PutLane
from app.api.server.runner import GatewayServer
from app.errors import KVGateError
from contract.wire import (
    BLOCK_META_HEADER,
    CHECKSUM_HEADER,
    DIGEST_HEADER,
    PART_CHECKSUM_HEADER,
    PART_DIGEST_HEADER,
    WireError,
)
from tests.api.test_head_lane import _exchange, _read_answers, _req, _request_samples
from tests.api.test_head_lane import _pair as pair_of_servers
from tests.conftest import crc_header, key_for, random_bytes, sha
from tests.inprocess.harness import running, served_server, settings_for
from tests.security.conftest import OTHER_NS, TOKENS, tokens_json

CHUNKED = b"3\r\nabc\r\n0\r\n\r\n"
BODY1, BODY2, BODY3 = random_bytes(5000, seed=1), random_bytes(65_536, seed=2), random_bytes(10, seed=3)


def _lane(server: GatewayServer) -> PutLane | None:
    lane: PutLane | None = getattr(server.server.config.http, "put_lane", None)
    return lane


def _put(key: str, body: bytes, *headers: str, version: str = "1.1") -> tuple[str, bytes]:
    method, head = _req("PUT", f"/v1/blocks/{key}", f"Content-Length: {len(body)}", *headers, version=version)
    return method, head + body


@contextlib.contextmanager
def _pair(tmp_path: Path, **fields: Any) -> Iterator[tuple[tuple[str, GatewayServer], tuple[str, GatewayServer]]]:
    with pair_of_servers(tmp_path, lane="put_lane", **fields) as servers:
        yield servers


def _stored(url: str, keys: list[str], headers: dict[str, str] | None = None) -> list[tuple[int, bytes, str | None]]:
    with httpx.Client(base_url=url, headers=headers) as c:
        out = []
        for key in keys:
            r = c.get(f"/v1/blocks/{key}")
            out.append((r.status_code, r.content, r.headers.get("etag")))
        return out


def test_the_lane_answers_and_stores_as_the_full_stack(tmp_path: Path) -> None:
    k = [key_for(100 + i) for i in range(20)]
    pct = k[0].replace("_g0/", "%5Fg0/")  # uvicorn decodes the path: the same key
    meta = "X-KVGate-Block-Meta: parent=00112233445566778899aabbccddeeff; tokens=1,2,3"
    cases: list[tuple[str, list[tuple[str, bytes]], int]] = [
        # (what, requests sent in one write, how many the lane takes)
        ("new block", [_put(k[0], BODY1)], 1),
        ("identical again", [_put(k[0], BODY1)], 1),
        ("percent-encoded path, changed bytes", [_put(pct, BODY2)], 1),
        ("create-only over a block", [_put(k[0], BODY1, "If-None-Match: *")], 1),
        ("create-only, new", [_put(k[1], BODY3, "If-None-Match: *")], 1),
        ("If-None-Match other than *", [_put(k[2], BODY3, 'If-None-Match: "x"')], 0),
        ("checksum that matches", [_put(k[3], BODY2, f"X-KVGate-Checksum: {crc_header(BODY2)}")], 1),
        ("checksum that does not match", [_put(k[4], BODY2, f"X-KVGate-Checksum: {crc_header(BODY1)}")], 1),
        ("earlier client's sha256", [_put(k[5], BODY1, f"X-KVGate-SHA256: {sha(BODY1)}")], 1),
        ("sha256 that does not match", [_put(k[6], BODY1, f"X-KVGate-SHA256: {sha(BODY3)}")], 1),
        ("malformed checksum", [_put(k[7], BODY1, "X-KVGate-Checksum: crc64nvme=!!")], 0),
        ("block meta", [_put(k[8], BODY3, meta)], 1),
        ("malformed block meta", [_put(k[9], BODY3, "X-KVGate-Block-Meta: tokens=x")], 0),
        ("bad key", [_put("not-a-key", BODY3)], 0),
        ("query string", [("PUT", _put(k[10], b"abc")[1].replace(b".bin HTTP", b".bin?x=1 HTTP", 1))], 0),
        ("a part", [_put(k[11], BODY3, "Content-Range: bytes 0-9/20")], 0),
        ("Expect: 100-continue", [_put(k[12], BODY3, "Expect: 100-continue")], 0),
        ("chunked body", [("PUT", _req("PUT", f"/v1/blocks/{k[13]}", "Transfer-Encoding: chunked")[1] + CHUNKED)], 0),
        ("HTTP/1.0", [_put(k[14], BODY1, version="1.0")], 1),
        ("Connection: close, then another request", [_put(k[15], BODY1, "Connection: close"), _put(k[16], BODY1)], 1),
        (
            "pipelined behind a lane PUT",
            [_put(k[17], BODY2), _req("HEAD", f"/v1/blocks/{k[17]}"), _req("GET", f"/v1/blocks/{k[17]}"),
             _put(k[18], BODY1), _req("GET", f"/v1/blocks/{k[18]}")],
            1,
        ),
        ("keep-alive: several in turn", [_put(k[19], BODY1), _put(k[19], BODY3), _put(k[19], BODY1)], 1),
    ]  # fmt: skip
    with _pair(tmp_path) as ((lane_url, lane_server), (stack_url, _)):
        lane = _lane(lane_server)
        assert lane is not None
        statuses = set()
        for what, requests, taken in cases:
            before = lane.served
            got, got_closed = _exchange(lane_url, requests)
            statuses |= {int(answer.split(b" ")[1]) for answer in got}
            want, want_closed = _exchange(stack_url, requests)
            assert got == want, what
            assert got_closed == want_closed, what
            assert len(got) >= 1, what
            if taken == 0:
                assert lane.served == before, what  # a request it must not take went to the stack
            else:
                assert lane.served - before >= taken, what
        assert statuses == {100, 200, 201, 202, 400, 411, 412}
        assert _stored(lane_url, k) == _stored(stack_url, k)
        assert _request_samples(lane_url) == _request_samples(stack_url)
        assert lane.served >= sum(taken for _, _, taken in cases)


def _split_put(url: str, key: str, body: bytes, pause_s: float, *, cut: int = 1000) -> bytes:
    """A PUT whose head and first ``cut`` body bytes go in one write, the rest ``pause_s`` later; the answer."""
    parts = urlsplit(url)
    method, raw = _put(key, body)
    split = len(raw) - len(body) + cut
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(raw[:split])
        time.sleep(pause_s)
        sock.sendall(raw[split:])
        return _read_answers(sock, [method])[0]


def test_a_body_late_past_the_wait_goes_to_the_stack(tmp_path: Path) -> None:
    """The lane waits BODY_WAIT_S for the rest of a body, then hands the request to the stack (its rate and pause
    guards) with the bytes so far: a body in two writes a moment apart is the lane's, one whose rest comes after
    the wait is the stack's. The bytes stored and the answers are the same either way."""
    assert BODY_WAIT_S == 0.25
    with _pair(tmp_path) as ((lane_url, lane_server), (stack_url, _)):
        lane = _lane(lane_server)
        assert lane is not None
        for i, (pause, taken) in enumerate([(0.02, 1), (0.6, 0)]):
            key = key_for(400 + i)
            before = lane.served
            answers = [_split_put(url, key, BODY2, pause) for url in (lane_url, stack_url)]
            assert answers[0] == answers[1] and answers[0].startswith(b"HTTP/1.1 201 "), pause
            assert lane.served - before == taken, pause
            etag = answers[0].split(b"etag: ")[1].split(b"\r\n")[0].decode()
            assert _stored(lane_url, [key]) == _stored(stack_url, [key]) == [(200, BODY2, etag)]
        big = random_bytes(MAX_BODY_BYTES + 1, seed=9)  # over the lane's bound: the stack's, however it comes
        assert _exchange(lane_url, [_put(key_for(402), big)])[0][0].startswith(b"HTTP/1.1 201 ")
        assert lane.served == 1


def test_a_client_gone_mid_body_gives_its_slot_back(tmp_path: Path) -> None:
    """A PUT the lane took whose client leaves before the body is all here stores nothing and frees its upload
    slot (with one slot, the next PUT is stored, not refused 429)."""
    with served_server(settings_for(tmp_path, fs=True, max_uploads_in_flight=1)) as (url, server):
        lane = _lane(server)
        assert lane is not None
        parts = urlsplit(url)
        _, raw = _put(key_for(500), BODY2)
        for _ in range(3):
            with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
                sock.sendall(raw[: len(raw) - 100])
                time.sleep(0.05)
            time.sleep(0.05)
            stored, _ = _exchange(url, [_put(key_for(501), BODY1)])
            assert stored[0].split(b" ")[1] in (b"200", b"201"), stored
        with httpx.Client(base_url=url) as c:
            assert c.head(f"/v1/blocks/{key_for(500)}").status_code == 404
        assert lane.served == 3


def test_the_lane_holds_at_most_its_bytes_and_gives_them_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``max_held`` body bytes at once (collecting or being stored), a PUT is the stack's: the lane's bound on
    memory besides the upload slots. A PUT abandoned mid-body gives its bytes back."""
    monkeypatch.setattr(lanes, "BODY_WAIT_S", 10.0)  # the held PUT stays the lane's while the test looks
    with served_server(settings_for(tmp_path, fs=True)) as (url, server):
        lane = _lane(server)
        assert lane is not None
        lane.max_held = len(BODY2) + len(BODY1) - 1  # room for BODY2, or for BODY1, not both
        parts = urlsplit(url)
        _, raw = _put(key_for(600), BODY2)
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as slow:
            slow.sendall(raw[: len(raw) - 100])
            for _ in range(100):
                if lane.held:
                    break
                time.sleep(0.01)
            assert lane.held == len(BODY2)
            stored, _ = _exchange(url, [_put(key_for(601), BODY1)])
            assert stored[0].startswith(b"HTTP/1.1 201 ") and lane.served == 0  # the stack's
        for _ in range(100):
            if not lane.held:
                break
            time.sleep(0.01)
        assert lane.held == 0
        for key, body in ((602, BODY1), (603, BODY2)):
            stored, _ = _exchange(url, [_put(key_for(key), body)])
            assert stored[0].startswith(b"HTTP/1.1 201 ")
        assert lane.served == 2
        assert lane.held == 0
        with httpx.Client(base_url=url) as c:
            got = [c.get(f"/v1/blocks/{key_for(k)}").content for k in (601, 602, 603)]
            assert got == [BODY1, BODY1, BODY2]


def test_the_lane_applies_auth_as_the_stack(tmp_path: Path) -> None:
    who = [None, "read", "write", "admin", "other", "scoped_admin", "bad"]
    with _pair(tmp_path, tokens=json.loads(tokens_json())) as ((lane_url, lane_server), (stack_url, _)):
        lane = _lane(lane_server)
        assert lane is not None
        statuses = {}
        for i, name in enumerate(who):
            auth = [] if name is None else [f"Authorization: Bearer {TOKENS.get(name, 'not-a-token')}"]
            for key in (key_for(200 + i), key_for(200 + i, namespace=OTHER_NS)):
                before = lane.served
                got, _ = _exchange(lane_url, [_put(key, BODY1, *auth)])
                want, _ = _exchange(stack_url, [_put(key, BODY1, *auth)])
                assert got == want, (name, key)
                status = int(got[0].split(b" ")[1])
                statuses[name, key.startswith(OTHER_NS)] = status
                assert lane.served - before == (1 if status == 201 else 0), (name, key)
        assert statuses == {
            (None, False): 401, (None, True): 401, ("read", False): 403, ("read", True): 403,
            ("write", False): 201, ("write", True): 201, ("admin", False): 201, ("admin", True): 201,
            ("other", False): 403, ("other", True): 201, ("scoped_admin", False): 201, ("scoped_admin", True): 403,
            ("bad", False): 401, ("bad", True): 401,
        }  # fmt: skip
        admin = {"Authorization": f"Bearer {TOKENS['admin']}"}
        assert _request_samples(lane_url, admin) == _request_samples(stack_url, admin)


def test_the_lane_and_the_stack_share_the_upload_slots(tmp_path: Path) -> None:
    """``max_uploads_in_flight`` counts the lane's PUTs and the stack's together: with the one slot held by a PUT
    whose body is still coming (the stack's), a whole PUT gets the stack's 429, and after it a 201 from the lane."""
    with _pair(tmp_path, max_uploads_in_flight=1) as ((lane_url, lane_server), (stack_url, _)):
        lane = _lane(lane_server)
        assert lane is not None
        for url in (lane_url, stack_url):
            parts = urlsplit(url)
            method, raw = _put(key_for(300), BODY2)
            with socket.create_connection((parts.hostname, parts.port), timeout=10) as slow:
                slow.sendall(raw[: len(raw) - 100])  # holds the slot: its body is not complete
                time.sleep(0.3)
                refused, _ = _exchange(url, [_put(key_for(301), BODY1)])
                assert refused[0].startswith(b"HTTP/1.1 429 "), refused
                slow.sendall(raw[len(raw) - 100 :])
                assert _read_answers(slow, [method])[0].startswith(b"HTTP/1.1 201 ")
            stored, _ = _exchange(url, [_put(key_for(301), BODY1)])
            assert stored[0].startswith(b"HTTP/1.1 201 "), stored
        assert lane.served == 1
        assert _request_samples(lane_url) == _request_samples(stack_url)


def test_an_oversized_head_is_answered_431_not_by_a_lane(tmp_path: Path) -> None:
    """A request head over ``max_header_bytes`` that arrives in one read is answered 431 by the head bounds, HEAD
    and PUT alike: no lane takes it (the HEAD lane answered such a HEAD 200 before)."""
    big = "X-Filler: " + "a" * 9000
    with served_server(settings_for(tmp_path, fs=True, max_header_bytes=8192)) as (url, _):
        with httpx.Client(base_url=url) as c:
            assert c.put(f"/v1/blocks/{key_for(1)}", content=BODY1).status_code == 201
        for request in (_req("HEAD", f"/v1/blocks/{key_for(1)}", big), _put(key_for(2), BODY1, big)):
            answers, _ = _exchange(url, [request])
            assert answers[0].startswith(b"HTTP/1.1 431 "), answers
        with httpx.Client(base_url=url) as c:
            assert c.head(f"/v1/blocks/{key_for(2)}").status_code == 404


class _ReadHeaders(Headers):
    """A request's headers that note each name looked up; ``*`` for a scan of them all."""

    def __init__(self, scope: dict[str, Any], read: set[str]) -> None:
        super().__init__(scope=scope)
        self.read = read

    def __getitem__(self, key: str) -> str:
        self.read.add(key.lower())
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.read.add(str(key).lower())
        return super().__contains__(key)

    def getlist(self, key: str) -> list[str]:
        self.read.add(key.lower())
        return super().getlist(key)

    def raw_scan(self) -> None:
        self.read.add("*")

    def keys(self) -> list[str]:  # type: ignore[override]
        self.raw_scan()
        return super().keys()

    def values(self) -> list[str]:  # type: ignore[override]
        self.raw_scan()
        return super().values()

    def items(self) -> list[tuple[str, str]]:  # type: ignore[override]
        self.raw_scan()
        return super().items()

    def __iter__(self) -> Iterator[str]:
        self.raw_scan()
        return super().__iter__()


async def test_the_lane_knows_every_header_the_put_route_reads(tmp_path: Path) -> None:
    """Every request header the PUT route reads is one the lane reads or sends to the stack: a header the route
    starts reading cannot be dropped on the lane's path. The route reads its declared ``Header()`` parameters (what
    its binding, ThinRoute's or FastAPI's, looks up) and whatever it looks up in ``request.headers``: its handler is
    called in process, for each kind of PUT (whole, create-only, with each checksum and the block meta, parts, bad
    headers), with headers that note each name it looks up."""
    route = next(r for r in blocks.router.routes if "PUT" in (getattr(r, "methods", None) or ()))
    bound = {_header_name(field) for field in route.dependant.header_params}
    handler = route.get_route_handler()
    body = BODY3
    meta = "parent=00112233445566778899aabbccddeeff; tokens=1,2,3"
    whole = [{}, {"If-None-Match": "*"}, {CHECKSUM_HEADER: crc_header(body)}, {DIGEST_HEADER: sha(body)}]
    whole += [{BLOCK_META_HEADER: meta}, {CHECKSUM_HEADER: "crc64nvme=!!"}, {"If-None-Match": '"x"'}]
    parts = [
        {"Content-Range": "bytes 0-9/20", PART_CHECKSUM_HEADER: crc_header(body)},
        {"Content-Range": "bytes 10-19/20", PART_DIGEST_HEADER: sha(body)},
        {"Content-Range": "bytes 0-9/5"},
    ]
    read: set[str] = set()
    statuses: list[int | str] = []
    async with running(settings_for(tmp_path)) as gw:
        for i, extra in enumerate(whole + parts):
            key = key_for(750 if "Content-Range" in extra else 700 + i)
            headers = {"Content-Length": str(len(body)), **extra}
            scope: dict[str, Any] = {
                "type": "http",
                "http_version": "1.1",
                "method": "PUT",
                "scheme": "http",
                "path": f"/v1/blocks/{key}",
                "raw_path": f"/v1/blocks/{key}".encode(),
                "query_string": b"",
                "root_path": "",
                "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()],
                "app": gw.app,
                "path_params": {"path": key},
            }
            sent = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive(sent: list[dict[str, Any]] = sent) -> dict[str, Any]:
                return sent.pop(0) if sent else {"type": "http.disconnect"}

            request = Request(scope, receive)
            request._headers = _ReadHeaders(scope, read)
            try:
                statuses.append((await handler(request)).status_code)
            except (KVGateError, WireError) as exc:
                statuses.append(type(exc).__name__)
    assert statuses == [201, 201, 201, 201, 201, "MalformedHeader", "InvalidRequest", 202, 201, "RangeNotSatisfiable"]
    lane_knows = {name.decode() for name in (*put_lane._READ, *put_lane._STACK_ONLY)}
    assert bound | read <= lane_knows, (
        f"the route reads headers the PUT lane does not know: {(bound | read) - lane_knows}"
    )
    assert bound | read == set(PUT_HEADERS)
