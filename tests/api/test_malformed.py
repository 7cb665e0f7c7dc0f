"""Malformed input gets a JSON 4xx and changes nothing (found by an outside tester: each was a plain-text 500)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.api.errors import lookup
from app.errors import RangeNotSatisfiable
from contract import wire
from contract.wire import MalformedHeader
from tests.conftest import TEST_NS, key_for


def _json_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    code: str = r.json()["error"]["code"]
    return code


@pytest.mark.parametrize("spec", ["bytes=²-5", "bytes=1-²", "bytes=-٣", "bytes=0x1-2", "bytes=1-2,3-4", "items=0-1"])
async def test_malformed_range_is_400(client: httpx.AsyncClient, spec: str) -> None:
    key = key_for(1)
    assert (await client.put(f"/v1/blocks/{key}", content=b"x" * 100)).status_code == 201
    try:  # as a client sends it on the wire: latin-1 where it can ('²' is b"\xb2"), else UTF-8
        raw = spec.encode("latin-1")
    except UnicodeEncodeError:
        raw = spec.encode()
    r = await client.get(f"/v1/blocks/{key}", headers={b"Range": raw})
    assert _json_error(r, 400) == "invalid_request"


async def test_suffix_range_of_an_empty_object_is_416(client: httpx.AsyncClient) -> None:
    key = key_for(2)
    assert (await client.put(f"/v1/blocks/{key}", content=b"")).status_code == 201
    for spec in ("bytes=-1", "bytes=0-0", "bytes=0-"):
        r = await client.get(f"/v1/blocks/{key}", headers={"Range": spec})
        assert _json_error(r, 416) == "range_not_satisfiable"
        assert r.headers["content-range"] == "bytes */0"
    assert (await client.get(f"/v1/blocks/{key}")).content == b""


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model_name": 7},
        {"model_name": "m", "kv_cache_groups": [[1]] * 10},
        {"model_name": "m", "x": list(range(500_000))},
    ],
    ids=["empty", "model-not-str", "odd-groups", "huge-array"],
)
async def test_bad_namespace_config_is_4xx_and_stores_nothing(client: httpx.AsyncClient, body: object) -> None:
    r = await client.put(f"/v1/namespaces/{TEST_NS}/config", json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert "error" in r.json()
    assert (await client.get(f"/v1/namespaces/{TEST_NS}/config")).status_code == 404


@given(st.text(max_size=40), st.integers(min_value=0, max_value=10_000))
def test_resolve_range_never_fails_otherwise(spec: str, size: int) -> None:
    """Any header value: a range inside the object, or a 400/416 error; never another exception."""
    try:
        got = wire.parse_range(spec, size=size)
    except (MalformedHeader, RangeNotSatisfiable) as exc:
        assert lookup(exc)[0] in (400, 416)
        return
    assert got is not None
    start, end = got
    assert 0 <= start < end <= size


@pytest.mark.parametrize(
    ("path", "methods"),
    [
        (f"/v1/blocks/{key_for(3)}", "DELETE, GET, HEAD, PUT"),
        (f"/v1/namespaces/{TEST_NS}/config", "GET, HEAD, PUT"),
        (f"/v1/namespaces/{TEST_NS}", "DELETE, GET, HEAD"),
        ("/v1/lookup", "POST"),
    ],
)
async def test_a_405_allows_every_method_of_the_resource(client: httpx.AsyncClient, path: str, methods: str) -> None:
    """A resource served by one route per method: Starlette's 405 named the first route's methods only (found by
    schemathesis: ``OPTIONS`` of a block said ``Allow: PUT``)."""
    for method in ("OPTIONS", "PATCH", "POST" if methods != "POST" else "PUT"):
        r = await client.request(method, path)
        assert _json_error(r, 405) == "method_not_allowed"
        assert r.headers["allow"] == methods, method
