"""The block data path is served by app.api.routes.thin.BlockFastPath, and answers exactly as FastAPI's full stack does.

BlockFastPath relies on Starlette/FastAPI details (route regexes, ``scope`` entries, exception handler lookup), so
these tests pin both: the same requests go to an app with the fast path and to one without it, and every answer
(status, headers, body) must be the same; and the fast path must be the one that ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.api.routes.thin import BlockFastPath
from app.config import Settings
from app.main import create_app
from tests.conftest import key_for, random_bytes, sha

BODY = random_bytes(10_000, seed=5)


def _fast_path(app: FastAPI) -> BlockFastPath | None:
    layer: Any = app.middleware_stack
    while layer is not None:
        if isinstance(layer, BlockFastPath):
            return layer
        layer = getattr(layer, "app", None)
    return None


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[tuple[TestClient, TestClient]]:
    fast = create_app(Settings(data_dir=tmp_path / "fast"))
    slow = create_app(Settings(data_dir=tmp_path / "slow"))
    slow.user_middleware = [m for m in slow.user_middleware if m.cls is not BlockFastPath]
    with TestClient(fast) as f, TestClient(slow) as s:
        yield f, s


def _requests() -> list[tuple[str, str, dict[str, str], bytes | None]]:
    key, other = key_for(1), key_for(2)
    return [
        ("HEAD", f"/v1/blocks/{key}", {}, None),  # 404
        ("GET", f"/v1/blocks/{key}", {}, None),  # 404 JSON
        ("PUT", f"/v1/blocks/{key}", {"X-KVGate-SHA256": sha(BODY)}, BODY),  # 201
        ("PUT", f"/v1/blocks/{key}", {"If-None-Match": "*"}, BODY),  # 412
        ("PUT", f"/v1/blocks/{key}", {"X-KVGate-SHA256": "zz"}, BODY),  # 400
        ("PUT", f"/v1/blocks/{other}", {"X-KVGate-SHA256": sha(b"other")}, BODY),  # 400 digest mismatch
        ("PUT", f"/v1/blocks/{other}", {"Content-Length": "-1"}, b""),  # 422 header validation
        ("HEAD", f"/v1/blocks/{key}", {}, None),
        ("GET", f"/v1/blocks/{key}", {}, None),
        ("GET", f"/v1/blocks/{key}", {"Range": "bytes=100-4195"}, None),
        ("GET", f"/v1/blocks/{key}", {"Range": "bytes=20000-"}, None),  # 416
        ("GET", "/v1/blocks/not-a-key", {}, None),  # 400
        ("GET", "/v1/blocks/a%0Ab", {}, None),  # no route takes a newline: the full stack's 400
        ("POST", f"/v1/blocks/{key}", {}, b""),  # 405 from the full stack
        ("DELETE", f"/v1/blocks/{key}", {}, None),
        ("GET", f"/v1/blocks/{key}", {}, None),
    ]


def _answer(client: TestClient, method: str, url: str, headers: dict[str, str], body: bytes | None) -> tuple[Any, ...]:
    r = client.request(method, url, headers=headers, content=body)
    kept = sorted((k, v) for k, v in r.headers.items() if k != "date")
    return r.status_code, kept, r.content


def test_fast_path_answers_as_the_full_stack(clients: tuple[TestClient, TestClient]) -> None:
    fast, slow = clients
    statuses = []
    for method, url, headers, body in _requests():
        got, want = _answer(fast, method, url, headers, body), _answer(slow, method, url, headers, body)
        assert got == want, (method, url)
        statuses.append(got[0])
    assert statuses == [404, 404, 201, 412, 400, 400, 422, 200, 200, 206, 416, 400, 400, 405, 204, 404]
    path = _fast_path(fast.app)  # type: ignore[arg-type]
    assert path is not None and _fast_path(slow.app) is None  # type: ignore[arg-type]
    # every block request but the two no route matches (newline, POST) was served by the fast path
    assert path.served == len(_requests()) - 2


def test_fast_path_records_the_route_for_metrics(clients: tuple[TestClient, TestClient]) -> None:
    fast, _ = clients
    key = key_for(3)
    assert fast.put(f"/v1/blocks/{key}", content=BODY).status_code == 201
    assert fast.head(f"/v1/blocks/{key}").status_code == 200
    text = fast.get("/metrics").text
    assert 'method="HEAD",route="/v1/blocks/{path}",status="200"' in text.replace("path:path", "path")
