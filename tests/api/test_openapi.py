"""The spec describes every route with its status codes, and Swagger UI serves."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema_rs
import pytest
from fastapi.routing import iter_route_contexts
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.routing import Route

from app.config import Settings
from app.main import create_app
from contract.keys import BLOCK_KEY_PATTERN, MAX_KEY_LEN, InvalidKey, block_path, parse_block_key, parse_namespace
from contract.wire import CHECKSUM_HEADER, DIGEST_HEADER, HEADER_PATTERNS
from tests.gateway import Gateway


def test_spec_covers_every_route(tmp_path: object) -> None:
    app = create_app(Settings())
    spec = app.openapi()
    documented = {(path, method.upper()) for path, ops in spec["paths"].items() for method in ops}
    served = set()
    for ctx in iter_route_contexts(app.routes):
        route = ctx.route
        if isinstance(route, Route) and not route.include_in_schema:
            continue
        methods = set(getattr(route, "methods", None) or ())
        for method in methods - ({"HEAD"} if "GET" in methods else set()):
            served.add((ctx.path.replace(":path}", "}"), method))
    assert len(served) >= 14  # the data plane, lookup, namespaces, admin and health routes
    assert served <= documented, served - documented

    blocks = spec["paths"]["/v1/blocks/{path}"]
    assert {"put", "get", "head", "delete"} <= set(blocks)
    assert {"200", "201", "400", "411", "412", "413", "503", "507"} <= set(blocks["put"]["responses"])
    assert {"200", "206", "404", "416"} <= set(blocks["get"]["responses"])
    assert {"200", "404"} <= set(blocks["head"]["responses"])
    assert "application/octet-stream" in blocks["put"]["requestBody"]["content"]
    assert "/v1/lookup" in spec["paths"]
    assert "/v1/namespaces/{namespace}/config" in spec["paths"]
    err = spec["components"]["schemas"]["ErrorResponse"]
    assert err["properties"]["error"]


def test_docs_and_spec_served(gateway: Gateway) -> None:
    docs = httpx.get(f"{gateway.url}/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text.lower()
    spec = httpx.get(f"{gateway.url}/openapi.json")
    assert spec.status_code == 200 and spec.json()["info"]["title"] == "kvgate"


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return create_app(Settings()).openapi()


def _matches(pattern: str, text: str) -> bool:
    """JSON Schema's reading of ``pattern`` (ECMA-262: ``$`` is the end of input, never before a last newline), by
    the validator schemathesis filters its cases through."""
    return bool(jsonschema_rs.validator_for({"type": "string", "pattern": pattern}).is_valid(text))


def _param(spec: dict[str, Any], path: str, method: str, name: str) -> dict[str, Any]:
    found = [p for p in spec["paths"][path][method]["parameters"] if p["name"].lower() == name.lower()]
    assert len(found) == 1, (path, method, name)
    schema: dict[str, Any] = found[0]["schema"]
    return schema


_NAMES = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,40}", fullmatch=True)


@given(
    model=_NAMES,
    digest=st.binary(min_size=6, max_size=6),
    rank=st.integers(0, 999_999),
    block_hash=st.binary(min_size=8, max_size=64),
    group=st.integers(0, 2**32 - 1),
)
@settings(max_examples=300, deadline=None)
def test_the_spec_patterns_accept_every_key_the_contract_accepts(
    spec: dict[str, Any], model: str, digest: bytes, rank: int, block_hash: bytes, group: int
) -> None:
    namespace = f"{model}_{digest.hex()}"
    key = block_path(namespace=namespace, rank=rank, block_hash=block_hash, group=group)
    if len(key) > MAX_KEY_LEN:
        return
    assert parse_block_key(key).path == key
    for method in ("put", "get", "head", "delete"):
        schema = _param(spec, "/v1/blocks/{path}", method, "path")
        assert _matches(schema["pattern"], key) and schema["maxLength"] == MAX_KEY_LEN
    items = spec["components"]["schemas"]["LookupRequest"]["properties"]["keys"]["items"]
    assert _matches(items["pattern"], key)
    for path in ("/v1/namespaces/{namespace}/config", "/v1/namespaces/{namespace}"):
        assert _matches(_param(spec, path, "get", "namespace")["pattern"], namespace)


@given(key=st.from_regex(BLOCK_KEY_PATTERN).filter(lambda k: _matches(BLOCK_KEY_PATTERN, k)))
@settings(max_examples=300, deadline=None)
def test_a_key_the_spec_generates_is_a_key(key: str) -> None:
    """What a client generated from the spec sends (schemathesis' positive cases) is a key, but for the bounds
    the pattern leaves to ``maxLength`` and the group's 2**32."""
    try:
        parse_block_key(key)
    except InvalidKey as exc:
        assert len(key) > MAX_KEY_LEN or "group" in str(exc), (key, exc)


@pytest.mark.parametrize(
    "bad",
    [
        "../etc/passwd",
        "/abs_0123456789ab_r0/000/10_g0/0001020304050607.bin",
        "m_0123456789ab_r0/001/10_g0/0001020304050607.bin",  # the directory is not the hash's prefix
        "m_0123456789ab_r0/000/10_g0/000102030405060.bin",  # an odd hash
        "m_0123456789ab_r01/000/10_g0/0001020304050607.bin",
        "m_0123456789ab_r0/000/10_g0/0001020304050607.bin\n",
        "m_0123456789AB_r0/000/10_g0/0001020304050607.bin",
        "m_0123456789ab/config.json",
    ],
)
def test_the_spec_patterns_reject_what_the_contract_rejects(spec: dict[str, Any], bad: str) -> None:
    with pytest.raises(InvalidKey):
        parse_block_key(bad)
    assert not _matches(_param(spec, "/v1/blocks/{path}", "get", "path")["pattern"], bad)


def test_the_spec_describes_inputs_as_parsed(spec: dict[str, Any]) -> None:
    put = spec["paths"]["/v1/blocks/{path}"]["put"]
    names = {p["name"].lower() for p in put["parameters"]}
    assert "content-length" not in names  # the framing's, not a parameter
    for header in (CHECKSUM_HEADER, DIGEST_HEADER, "If-None-Match", "Content-Range"):
        assert _param(spec, "/v1/blocks/{path}", "put", header)["pattern"] == HEADER_PATTERNS[header]
    assert _param(spec, "/v1/blocks/{path}", "get", "Range")["pattern"] == HEADER_PATTERNS["Range"]
    example = _param(spec, "/v1/blocks/{path}", "get", "path")["examples"][0]
    assert "/" in example and parse_block_key(example).path == example
    namespace = _param(spec, "/v1/namespaces/{namespace}/config", "put", "namespace")["examples"][0]
    assert parse_namespace(namespace) == namespace
    keys = spec["components"]["schemas"]["LookupRequest"]["properties"]["keys"]
    assert keys["maxItems"] == Settings().max_lookup_keys
    body = spec["paths"]["/v1/namespaces/{namespace}/config"]["put"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["required"] == ["model_name"]
