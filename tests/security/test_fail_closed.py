"""Inputs that reached a 5xx or slipped past a limit, each against a real gateway process: a header value outside
kvgate's ASCII grammar is a 400 (never a 500), a namespace-scoped lookup's body is read under the same limits as
every body, and the time the gateway itself takes before it reads a body is not counted against the client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for, random_bytes, sha
from tests.gateway import Gateway, free_port
from tests.security.conftest import OTHER_NS, bearer, tokens_json
from tests.security.raw_http import build, send_raw
from tests.services import PgServer, asyncpg_dsn

OTHER_KEY = key_for(5, namespace=OTHER_NS)
ADMIN = ("Authorization", bearer("admin")["Authorization"].encode())


@pytest.fixture(scope="module", params=["events-off", "events-on"])
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    env = {"KVGATE_TOKENS": tokens_json(), "KVGATE_BODY_IDLE_TIMEOUT_S": "2", "KVGATE_BODY_GRACE_S": "2"}
    if request.param == "events-on":
        env |= {
            "KVGATE_EVENTS_ENABLED": "true",
            "KVGATE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
            "KVGATE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        }
    gateway = Gateway(tmp_path_factory.mktemp("failclosed") / "data", env=env).start()
    yield gateway
    gateway.stop()


BAD_META = [
    b"tokens=\xb2",  # '²' as latin-1: str.isdigit() says yes, int() says no
    b"tokens=1,2,\xb2",
    "tokens=\u0661\u0662".encode(),  # Arabic-Indic digits: int() takes them, the grammar does not
    b"tokens=" + b"9" * 12,
    b"tokens=" + b"9" * 4301,
    b"tokens=1,,2",
    b"tokens=-1",
    b"parent=abc",
    b"parent=" + b"a" * 17,  # an odd number of hex digits is no hash
    b"parent=" + b"g" * 16,
    b"parent=\x00",
    b"colour=red",
    b"tokens=" + b",".join([b"1"] * 1025),
]


@pytest.mark.parametrize("value", BAD_META, ids=lambda v: repr(v[:24]))
def test_block_meta_outside_the_grammar_is_400(gw: Gateway, value: bytes) -> None:
    data = random_bytes(1000, 5)
    request = build(
        "PUT", f"/v1/blocks/{OTHER_KEY}", [ADMIN, ("X-KVGate-Block-Meta", value)], data, length=str(len(data)).encode()
    )
    status, head = send_raw(gw.port, request)
    assert status == 400, head
    with httpx.Client(base_url=gw.url, headers=bearer("admin")) as c:
        assert c.head(f"/v1/blocks/{OTHER_KEY}").status_code == 404  # nothing was stored
        ok = c.put(
            f"/v1/blocks/{OTHER_KEY}",
            content=data,
            headers={"X-KVGate-Block-Meta": "parent=00ff00ff00ff00ff; tokens=1,2"},
        )
        assert ok.status_code == 201
        assert c.delete(f"/v1/blocks/{OTHER_KEY}").status_code == 204


@pytest.mark.parametrize(
    "value", [b"\xb2", "\u0661".encode(), b"9" * 19, b"9" * 4301, b"-1", b"1.0", b" ", b"0x1", b"1_0", b"\x00"]
)
def test_last_event_id_outside_the_grammar_is_a_4xx(gw: Gateway, value: bytes) -> None:
    status, head = send_raw(gw.port, build("GET", "/v1/events", [ADMIN, ("Last-Event-ID", value)], b""))
    events_on = "KVGATE_EVENTS_ENABLED" in gw.extra_env
    if value == b"\x00":  # not a header value at all: the server's own parser refuses it
        assert status == 400, head
        return
    assert status == (400 if events_on else 404), head


@pytest.mark.parametrize("value", [b"", b"x", b"-1"])
def test_last_event_id_outside_the_grammar_is_a_4xx_beside_since(gw: Gateway, value: bytes) -> None:
    """``since`` wins over Last-Event-ID, but a malformed Last-Event-ID is still refused (it was read only without
    ``since``, so a malformed one next to it got the stream: schemathesis' negative_data_rejection)."""
    status, head = send_raw(gw.port, build("GET", "/v1/events?since=0", [ADMIN, ("Last-Event-ID", value)], b""))
    assert status == (400 if "KVGATE_EVENTS_ENABLED" in gw.extra_env else 404), head


@pytest.mark.parametrize("query", ["since=%C2%B2", "since=" + "9" * 4301, "since=-1", "since=1_000", "namespace=%00"])
def test_event_queries_outside_the_grammar_are_a_4xx(gw: Gateway, query: str) -> None:
    status, head = send_raw(gw.port, build("GET", f"/v1/events?{query}", [ADMIN], b""))
    assert 400 <= status < 500, head


def deep(depth: int) -> bytes:
    return b'{"keys": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("who", ["other", "admin"])
@pytest.mark.parametrize(
    "body", [deep(100_000), deep(1_000), b"[" * 50_000, b'{"keys": [' + b"1" * 5000 + b"]}", b'{"keys": NaN}', b"\xff"]
)
def test_lookup_bodies_outside_the_grammar_are_400(gw: Gateway, who: str, body: bytes) -> None:
    """The namespace-scoped principal's body is read by auth (to check every key's namespace), the admin's by the
    route: either way a 4xx."""
    with httpx.Client(base_url=gw.url, headers=bearer(who)) as c:
        r = c.post("/v1/lookup", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code in (400, 422), r.text[:300]
    assert set(r.json()) == {"error"}


def test_a_scoped_lookup_body_is_held_to_the_body_limits(gw: Gateway) -> None:
    """A namespace-scoped principal's lookup body stalls halfway: the guard answers 408 (idle 2 s), as it does for
    everyone else's body, instead of auth waiting for it without a bound."""
    body = json.dumps({"keys": [OTHER_KEY]}).encode()
    head = build("POST", "/v1/lookup", [("Authorization", bearer("other")["Authorization"].encode())], body)
    head = head[: len(head) - len(body)] + body[:10]  # the head and 10 bytes; the rest never comes
    with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as sock:
        sock.sendall(head)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


async def test_the_gateways_own_wait_does_not_count_against_a_body(tmp_path: Path, pg_server: PgServer) -> None:
    """The index is locked (another session holds ``blocks`` exclusively), so a create-only PUT (which reads the
    index before its body, to refuse early) waits inside the gateway, before it reads its body, for longer than the
    body's grace and idle limits. The client sent its head and half its body
    at once, and the rest a second after the lock goes: it was never slow by its own clock (the time spent waiting
    for its bytes), and its block is stored."""
    import asyncpg  # type: ignore[import-untyped]

    db_url = await pg_server.create_database()
    env = {
        "KVGATE_DB_URL": db_url,
        "KVGATE_TOKENS": tokens_json(),
        "KVGATE_BODY_GRACE_S": "2",
        "KVGATE_BODY_IDLE_TIMEOUT_S": "2",
    }
    gw = Gateway(tmp_path / "data", env=env)
    await asyncio.to_thread(gw.start)
    conn = await asyncpg.connect(asyncpg_dsn(db_url))
    try:
        data = random_bytes(256 * 1024, 77)
        request = build(
            "PUT",
            f"/v1/blocks/{OTHER_KEY}",
            [ADMIN, ("X-KVGate-SHA256", sha(data).encode()), ("If-None-Match", b"*")],
            data,
        )
        first, rest = request[: len(request) - len(data) // 2], request[len(request) - len(data) // 2 :]
        lock = conn.transaction()
        await lock.start()
        await conn.execute("LOCK TABLE blocks IN ACCESS EXCLUSIVE MODE")
        sock = socket.create_connection(("127.0.0.1", gw.port), timeout=60)
        try:
            await asyncio.to_thread(sock.sendall, first)
            waiting = (
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
                " AND pid <> pg_backend_pid()"
            )
            deadline = time.monotonic() + 30
            while await conn.fetchval(waiting) == 0:
                assert time.monotonic() < deadline, "the PUT never waited on the index"
                await asyncio.sleep(0.05)
            await asyncio.sleep(5)  # the gateway's own wait: past grace (2 s) and idle (2 s)
            await lock.commit()
            await asyncio.sleep(1)  # the client takes its time with the rest, within its grace (2 s) and idle (2 s)
            await asyncio.to_thread(sock.sendall, rest)
            answer = await asyncio.to_thread(sock.recv, 65536)
        finally:
            sock.close()
        assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
        async with httpx.AsyncClient(base_url=gw.url, headers=bearer("admin")) as c:
            got = await c.get(f"/v1/blocks/{OTHER_KEY}")
        assert got.status_code == 200 and got.content == data
    finally:
        await conn.close()
        await asyncio.to_thread(gw.stop)
        await pg_server.drop_database(db_url)
