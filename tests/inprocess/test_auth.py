"""Auth in process: every route x every kind of caller -> 401/403/allowed, scoped tokens, bearer parsing.

The matrix itself (routes, callers, the expected outcome) is the end-to-end suite's, imported from
tests/security/test_auth_matrix.py so both check one table; here it runs without a server.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from starlette.applications import Starlette
from starlette.routing import Mount

from tests.conftest import TEST_NS, key_for, random_bytes
from tests.inprocess.harness import InProcessGateway, running, settings_for
from tests.security.conftest import OTHER_NS, TOKENS, bearer, tokens_json
from tests.security.test_auth_matrix import CALLS, DATA, FIELDS, KEY, WHO, expected


@contextlib.asynccontextmanager
async def _seeded(where: Path) -> AsyncIterator[InProcessGateway]:
    """A gateway with the matrix's tokens, holding the matrix's block and namespace config."""
    async with running(settings_for(where, tokens=json.loads(tokens_json()))) as g:
        admin = bearer("admin")
        assert (await g.client.put(f"/v1/blocks/{KEY}", content=DATA, headers=admin)).status_code == 201
        assert (await g.client.put(f"/v1/namespaces/{TEST_NS}/config", json=FIELDS, headers=admin)).status_code == 201
        yield g


@pytest.fixture
async def secure(tmp_path: Path) -> AsyncIterator[InProcessGateway]:
    async with _seeded(tmp_path) as g:
        yield g


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def matrix_gw(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[InProcessGateway]:
    """One seeded gateway for every run of the matrix: each call the matrix allows leaves the state as it found it
    (the same block and config PUT again, a DELETE of an absent block, of an empty namespace), and each run checks
    the seeded block afterwards, so the runs share it."""
    async with _seeded(tmp_path_factory.mktemp("auth-matrix")) as g:
        yield g


async def _matrix(client: httpx.AsyncClient, who: str) -> list[tuple[str, str, str, int, str]]:
    """Every call of the matrix as ``who``: the ones whose answer is not the expected one."""
    token = WHO[who][0]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    wrong = []
    for call in CALLS:
        r = await client.request(call.method, call.url, headers=headers, content=call.body, json=call.json)
        want = expected(call, who)
        if want == "ok":
            if r.status_code not in call.ok:
                wrong.append((call.method, call.url, "ok", r.status_code, r.text[:200]))
            continue
        if r.status_code != int(want):
            wrong.append((call.method, call.url, want, r.status_code, r.text[:200]))
            continue
        if call.method != "HEAD":
            assert r.json()["error"]["code"] == ("unauthorized" if want == "401" else "forbidden")
        if want == "401":
            assert r.headers["www-authenticate"].startswith("Bearer")
    return wrong


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("who", list(WHO))
async def test_matrix(matrix_gw: InProcessGateway, who: str) -> None:
    assert await _matrix(matrix_gw.client, who) == []
    # what was refused changed nothing: the seeded block is still there, with its bytes
    got = await matrix_gw.client.get(f"/v1/blocks/{KEY}", headers=bearer("admin"))
    assert got.status_code == 200 and got.content == DATA


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("who", list(WHO))
async def test_matrix_mounted_under_a_path(matrix_gw: InProcessGateway, who: str) -> None:
    """The gateway mounted in another ASGI app at /kv (the mount puts /kv into root_path and path): auth finds the
    same route the router does, and answers as at the root."""
    parent = Starlette(routes=[Mount("/kv", app=matrix_gw.app)])
    transport = httpx.ASGITransport(app=parent)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgate.test/kv") as client:
        assert await _matrix(client, who) == []
        got = await client.get(f"/v1/blocks/{KEY}", headers=bearer("admin"))
        assert got.status_code == 200 and got.content == DATA


async def test_refused_put_stores_nothing(secure: InProcessGateway) -> None:
    key, body = key_for(50), random_bytes(1000, 50)
    for who in ("none", "bad", "read"):
        token = WHO[who][0]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        assert (await secure.client.put(f"/v1/blocks/{key}", content=body, headers=headers)).status_code in (401, 403)
    assert (await secure.client.head(f"/v1/blocks/{key}", headers=bearer("admin"))).status_code == 404
    stats = await secure.stats(headers=bearer("admin"))
    assert stats["blocks"] == 1 and stats["usage_bytes"] == len(DATA)


async def test_scoped_tokens_stay_in_their_namespace(secure: InProcessGateway) -> None:
    c = secure.client
    other_key = key_for(7, namespace=OTHER_NS)
    body = random_bytes(1000, 7)
    assert (await c.put(f"/v1/blocks/{other_key}", content=body, headers=bearer("other"))).status_code == 201
    r = await c.get(f"/v1/blocks/{other_key}", headers=bearer("other"))
    assert r.status_code == 200 and r.content == body
    # each lookup key is checked: one key of another namespace refuses the whole lookup
    assert (await c.post("/v1/lookup", json={"keys": [other_key]}, headers=bearer("other"))).status_code == 200
    assert (await c.post("/v1/lookup", json={"keys": [other_key, KEY]}, headers=bearer("other"))).status_code == 403
    both = {"keys": [KEY, other_key]}
    assert (await c.post("/v1/lookup", json=both, headers=bearer("scoped_admin"))).status_code == 403
    # the namespace-limited admin may not read or delete another namespace's block
    assert (await c.get(f"/v1/blocks/{other_key}", headers=bearer("scoped_admin"))).status_code == 403
    assert (await c.delete(f"/v1/blocks/{other_key}", headers=bearer("scoped_admin"))).status_code == 403
    # a key that names no namespace is refused to a scoped token, not passed on
    assert (await c.get("/v1/blocks/garbage", headers=bearer("other"))).status_code == 403
    assert (await c.get(f"/v1/blocks/{other_key}", headers=bearer("admin"))).content == body


async def test_wrong_scheme_and_empty_token_are_401(secure: InProcessGateway) -> None:
    for value in (f"Basic {TOKENS['admin']}", "Bearer", TOKENS["admin"], f"Bearer {TOKENS['admin']}x", "Bearer  "):
        r = await secure.client.get("/v1/stats", headers={"Authorization": value})
        assert r.status_code == 401, value
        assert r.json()["error"]["code"] == "unauthorized"
    assert (
        await secure.client.get("/v1/stats", headers={"Authorization": f"bearer {TOKENS['admin']}"})
    ).status_code == 200


async def test_metrics_public(tmp_path: Path) -> None:
    async with running(settings_for(tmp_path, tokens=json.loads(tokens_json()), metrics_public=True)) as g:
        assert (await g.client.get("/metrics")).status_code == 200
        assert (await g.client.get("/v1/stats")).status_code == 401


async def test_auth_off_without_tokens(gw: InProcessGateway) -> None:
    assert (await gw.client.get("/v1/stats")).status_code == 200
    assert (await gw.client.put(f"/v1/blocks/{key_for(1)}", content=b"x")).status_code == 201
    assert (await gw.client.delete(f"/v1/blocks/{key_for(1)}")).status_code == 204
