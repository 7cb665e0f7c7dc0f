"""HTTP framing fails closed: an answer sent before a request's body was read in full says ``Connection: close`` and
the connection ends after it, so the next request on the connection is never read as the rest of that body.

For every early answer a PUT can get (400, 401, 403, 411, 413, 422, 507; kvgate checks no Content-Type, so no 415),
raw bytes on one connection: the PUT's head and only part of its body, the answer read, then ``GET /healthz``. The
GET must be answered (200) or refused by the closed connection (EOF, reset), never left hanging: before this, the
gateway read it as the PUT's body and never answered. Over plain HTTP and TLS, with the PUT lane on and off.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from contract.keys import block_path, namespace_for
from loopback.tls_pki import CA, TlsGateway, client_context
from tests.conftest import agnostic_fields, key_for
from tests.gateway import Gateway
from tests.security.conftest import TOKENS, tokens_json

MiB = 1024 * 1024
MAX_BLOCK = 3 * MiB
MAX_BYTES = 1 * MiB
"""The store's capacity: a block over it (and under MAX_BLOCK) is a 507 before its body is read."""
LAYOUT_FIELDS: dict[str, object] = {
    **agnostic_fields("framing/model", dtype="float16"),
    "canonical_format": "kvgate-v1-hnd",
    "block_bytes": 4096,
}
LAYOUT_KEY = block_path(namespace=namespace_for(LAYOUT_FIELDS), rank=0, block_hash=bytes(range(32)), group=0)
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
HANG_S = 5.0


@dataclass(frozen=True)
class Served:
    gateway: Gateway
    ca: Path | None

    def connect(self) -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", self.gateway.port), timeout=HANG_S)
        if self.ca is None:
            return raw
        return client_context(ca=self.ca).wrap_socket(raw, server_hostname="localhost")


def _start(tmp: Path, *, lane: bool, tls: bool) -> Served:
    env = {
        "KVGATE_TOKENS": tokens_json(),
        "KVGATE_MAX_BLOCK_BYTES": str(MAX_BLOCK),
        "KVGATE_MAX_BYTES": str(MAX_BYTES),
        "KVGATE_PUT_LANE": "true" if lane else "false",
    }
    if not tls:
        return Served(Gateway(tmp / "data", env=env).start(), None)
    ca = CA()
    ca_pem = ca.write(tmp / "ca.pem")
    cert, key = ca.issue("kvgate", server=True).write(tmp, "server")
    env |= {"KVGATE_TLS_CERTFILE": str(cert), "KVGATE_TLS_KEYFILE": str(key)}
    return Served(TlsGateway(tmp / "data", ca=ca_pem, env=env).start(), ca_pem)


@pytest.fixture(
    scope="module",
    params=[(False, False), (True, False), (False, True), (True, True)],
    ids=["stack", "lane", "tls-stack", "tls-lane"],
)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    lane, tls = request.param
    s = _start(tmp_path_factory.mktemp("framing"), lane=lane, tls=tls)
    verify: ssl.SSLContext | bool = client_context(ca=s.ca) if s.ca is not None else True
    admin = {"Authorization": f"Bearer {TOKENS['admin']}"}
    try:
        with httpx.Client(base_url=s.gateway.url, verify=verify, headers=admin, timeout=30) as c:
            ns = namespace_for(LAYOUT_FIELDS)
            assert c.put(f"/v1/namespaces/{ns}/config", json=LAYOUT_FIELDS).status_code == 201
        yield s
    finally:
        s.gateway.stop()


@dataclass(frozen=True)
class Early:
    status: int
    key: str
    headers: tuple[str, ...]
    length: int | None
    """The declared Content-Length (None: a chunked body)."""
    sent: int
    """Body bytes sent before the answer is read."""
    who: str | None = "write"


EARLY = {
    "400-checksum": Early(400, key_for(1), ("X-KVGate-Checksum: crc64nvme=not-base64!",), 100_000, 1_000),
    "400-key": Early(400, "/../etc/passwd", (), 100_000, 1_000),
    "401": Early(401, key_for(2), (), 100_000, 1_000, who=None),
    "401-expect": Early(401, key_for(2), ("Expect: 100-continue",), 100_000, 0, who=None),
    "403": Early(403, key_for(3), (), 100_000, 1_000, who="read"),
    "411": Early(411, key_for(4), ("Transfer-Encoding: chunked",), None, 1_000),
    "413": Early(413, key_for(5), (), 1_000_000_000, 0),
    "413-some": Early(413, key_for(6), (), MAX_BLOCK + 1, 1_000),
    "422": Early(422, LAYOUT_KEY, (), 100_000, 1_000),
    "507": Early(507, key_for(7), (), 2 * MiB, 1_000),
}


def _put(case: Early) -> bytes:
    lines = [f"PUT /v1/blocks/{case.key.lstrip('/')} HTTP/1.1", "Host: 127.0.0.1", *case.headers]
    if case.who is not None:
        lines.append(f"Authorization: Bearer {TOKENS[case.who]}")
    if case.length is not None:
        lines.append(f"Content-Length: {case.length}")
        body = b"b" * case.sent
    else:
        body = b"%x\r\n" % case.sent + b"b" * case.sent + b"\r\n"  # one chunk, and no last chunk
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole answer (its head and its Content-Length of body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        assert chunk, "closed in the answer's body"
        body += chunk
    return int(lines[0][9:12]), headers, body


def _next_request(sock: socket.socket) -> str:
    """``GET /healthz`` on the connection after an answer: 'answered', 'closed', or a failure (a hang included)."""
    try:
        sock.sendall(HEALTHZ)
        status, _, body = _answer(sock)
    except (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
        return "closed"
    except TimeoutError:
        pytest.fail(f"GET /healthz after the early answer was not answered within {HANG_S}s: read as the PUT's body")
    except AssertionError as exc:
        if "closed without an answer: b''" in str(exc):
            return "closed"
        raise
    assert status == 200, body
    return "answered"


@pytest.mark.parametrize("name", list(EARLY))
def test_an_early_answer_closes_the_connection(served: Served, name: str) -> None:
    case = EARLY[name]
    with contextlib.closing(served.connect()) as sock:
        sock.sendall(_put(case))
        status, headers, body = _answer(sock)
        assert status == case.status, body
        after = _next_request(sock)
        assert (headers.get("connection", "").lower(), after) == ("close", "closed"), headers


def test_an_answer_after_the_whole_body_keeps_the_connection(served: Served) -> None:
    """The guard costs nothing where the body was read: a refused PUT whose body was all sent, a stored one, and
    a lookup keep the connection for the next request."""
    refused = Early(401, key_for(8), (), 1_000, 1_000, who=None)
    stored = Early(201, key_for(9), (), 1_000, 1_000)
    lookup = json.dumps({"keys": [key_for(9)]}).encode()
    with contextlib.closing(served.connect()) as sock:
        for case in (refused, stored):
            sock.sendall(_put(case))
            status, headers, body = _answer(sock)
            assert status == case.status, body
            assert "connection" not in headers, headers
            assert _next_request(sock) == "answered"
        sock.sendall(
            b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
            + TOKENS["read"].encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % len(lookup)
            + lookup
        )
        status, headers, body = _answer(sock)
        assert (status, json.loads(body)["prefix"]) == (200, 1)
        assert _next_request(sock) == "answered"


@pytest.mark.parametrize("name", ["401", "413-some", "507"])
def test_a_client_that_sends_its_whole_body_first_gets_the_early_answer(served: Served, name: str) -> None:
    """The close lingers: a client that writes its whole body before it reads (as most do), its last bytes sent
    after the gateway has answered, gets the early answer, not a reset. Before, the gateway closed with the rest of
    the body still coming, the kernel answered those bytes with a reset and the answer was lost (a PUT refused 503
    while PostgreSQL was down came back as a ReadError in tests/e2e/test_outages.py)."""
    case = EARLY[name]
    assert case.length is not None
    head_and_some = _put(case)
    with contextlib.closing(served.connect()) as sock:
        sock.sendall(head_and_some)
        time.sleep(0.5)  # the gateway answers meanwhile; the client, not reading yet, sends the rest of its body
        try:
            sock.sendall(b"b" * (case.length - case.sent))
        except (ConnectionResetError, BrokenPipeError) as exc:
            pytest.fail(f"the connection was reset under the client's body: {exc!r}")
        try:
            status, headers, body = _answer(sock)
        except ConnectionResetError as exc:
            pytest.fail(f"the early answer was lost to a reset: {exc!r}")
        assert (status, headers.get("connection", "").lower()) == (case.status, "close"), body
        assert _next_request(sock) == "closed"
