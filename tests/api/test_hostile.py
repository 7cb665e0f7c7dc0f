"""Malicious and malformed paths and headers: each a 4xx with the JSON error, nothing written outside the root."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for
from tests.gateway import Gateway

GOOD = key_for(1)
NS = GOOD.split("_r0/")[0]

BAD_PATHS = [
    "../../../../tmp/kvgate-escape.bin",
    "..%2f..%2f..%2ftmp%2fkvgate-escape.bin",
    "%2e%2e/%2e%2e/tmp/kvgate-escape.bin",
    "%2e%2e%2f%2e%2e%2ftmp%2fkvgate-escape.bin",
    "..%5c..%5ctmp%5ckvgate-escape.bin",
    "%2ftmp%2fkvgate-escape.bin",
    "/tmp/kvgate-escape.bin",
    f"{NS}_r0/../../../tmp/kvgate-escape.bin",
    GOOD.replace("/", "//", 1),
    GOOD + "%00",
    GOOD.replace(".bin", "%00.bin"),
    GOOD.replace("/", "\\", 1),
    GOOD.upper(),
    GOOD + "/extra",
    GOOD.replace(".bin", ".txt"),
    f"{NS}/config.json",
    f".{NS}_r0/abc/de_g0/abcdef0123456789.bin",
    "a" * 2000,
    f"{NS}_r0/abc/de_g0/abcdefXY23456789.bin",
    f"{NS}_r0/%C0%AE%C0%AE/de_g0/abcdef0123456789.bin",
    f"{NS}_r0/abc/de_g0/abcdef0123456789.bin%20",
    "",
]


def walk_outside(tmp_path: Path, before: set[str]) -> set[str]:
    """Files that appeared anywhere under /tmp except inside the test's own tmp dir."""
    after = {str(p) for p in Path("/tmp").glob("kvgate-escape*")}
    return after - before


@pytest.mark.parametrize("method", ["PUT", "GET", "DELETE"])
def test_bad_paths(gateway: Gateway, tmp_path: Path, method: str) -> None:
    before = {str(p) for p in Path("/tmp").glob("kvgate-escape*")}
    data_before = sorted(str(p) for p in gateway.data_dir.rglob("*"))
    with httpx.Client(base_url=gateway.url) as c:
        for path in BAD_PATHS:
            r = c.request(method, f"/v1/blocks/{path}", content=b"evil" if method == "PUT" else None)
            assert 400 <= r.status_code < 500, (path, r.status_code)
            body = r.json()
            assert set(body) == {"error"} and {"code", "message"} <= set(body["error"]), (path, body)
    assert walk_outside(tmp_path, before) == set()
    assert sorted(str(p) for p in gateway.data_dir.rglob("*")) == data_before


def raw_request(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        chunks = []
        while True:
            try:
                piece = s.recv(65536)
            except TimeoutError:
                break
            if not piece:
                break
            chunks.append(piece)
            if b"\r\n\r\n" in b"".join(chunks) and b'"error"' in piece:
                break
        return b"".join(chunks)


def test_raw_traversal_bypassing_client_normalisation(gateway: Gateway) -> None:
    for target in (b"/v1/blocks/../../../../tmp/kvgate-escape.bin", b"/v1/blocks/%2e%2e/%2e%2e/x.bin"):
        resp = raw_request(gateway.port, b"PUT " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nevil")
        status = int(resp.split(b" ", 2)[1])
        assert 400 <= status < 500, resp[:200]
    assert list(Path("/tmp").glob("kvgate-escape*")) == []


BAD_HEADERS: list[tuple[dict[str, str], int, str]] = [
    ({"X-KVGate-SHA256": "not-hex"}, 400, "invalid_request"),
    ({"X-KVGate-SHA256": "ab" * 31}, 400, "invalid_request"),
    ({"If-None-Match": '"abc"'}, 400, "invalid_request"),
    ({"Range": "bytes=5-2"}, 416, "range_not_satisfiable"),
    ({"Range": "items=0-1"}, 400, "invalid_request"),
    ({"Range": "bytes=0-1,4-5"}, 400, "invalid_request"),
    ({"Range": "bytes=abc"}, 400, "invalid_request"),
    ({"Range": "bytes=-0"}, 416, "range_not_satisfiable"),
]


def test_bad_headers(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url) as c:
        assert c.put(f"/v1/blocks/{GOOD}", content=b"0123456789").status_code == 201
        for headers, status, code in BAD_HEADERS:
            method = "GET" if "Range" in headers else "PUT"
            r = c.request(method, f"/v1/blocks/{GOOD}", headers=headers, content=b"xx" if method == "PUT" else None)
            assert r.status_code == status, (headers, r.status_code, r.text)
            assert r.json()["error"]["code"] == code
        assert c.get(f"/v1/blocks/{GOOD}").content == b"0123456789"
        # Content-Length longer than the body: the server times out or the client gives up, nothing is stored.
        resp = raw_request(
            gateway.port, f"PUT /v1/blocks/{key_for(2)} HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n".encode()
        )
        assert resp.startswith(b"HTTP/1.1 4"), resp[:100]
        assert c.head(f"/v1/blocks/{key_for(2)}").status_code == 404
        r = c.post("/v1/lookup", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
        r = c.post("/v1/lookup", json={"keys": ["../x"]})
        assert r.status_code == 400
    files = {"blocks", "index.db", "index.db-shm", "index.db-wal", "index.db.migrate.lock", "kvgate.coord"}
    files.add(".index.db.kvgate-owner")  # which data directory coordinates the index (app/core/ownership.py)
    assert set(os.listdir(gateway.data_dir)) <= files
