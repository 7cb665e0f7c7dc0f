"""The spec describes every route with its status codes, and Swagger UI serves."""

from __future__ import annotations

import contextlib
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
from contract.keys import (
    BLOCK_KEY_PATTERN,
    MAX_KEY_LEN,
    NAMESPACE_PATTERN,
    InvalidKey,
    block_path,
    parse_block_key,
    parse_namespace,
)
from contract.wire import (
    CHECKSUM_HEADER,
    DIGEST_HEADER,
    HEADER_PATTERNS,
    MalformedHeader,
    RangeNotSatisfiable,
    parse_checksum,
    parse_range,
)
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
    """What a client generated from the spec sends (schemathesis' positive cases) is a key, but for the bound the
    pattern leaves to ``maxLength``."""
    try:
        parse_block_key(key)
    except InvalidKey as exc:
        assert len(key) > MAX_KEY_LEN, (key, exc)


@pytest.mark.parametrize("group", [2**32 - 1, 2**32, 4_300_000_000, 9_999_999_999, 4_294_967_290, 4_294_967_300])
def test_the_key_pattern_bounds_the_group_as_the_contract_does(group: int) -> None:
    """A group of 2**32 or more is a 400 (vLLM's offload key holds it in 4 bytes): the pattern says so too, so a
    positive case never carries one (schemathesis' positive_data_acceptance got 400s) and a negative one may."""
    key = block_path(namespace="m_0123456789ab", rank=0, block_hash=bytes(range(8)), group=group)
    accepted = group < 2**32
    assert _matches(BLOCK_KEY_PATTERN, key) == accepted
    if accepted:
        assert parse_block_key(key).group == group
    else:
        with pytest.raises(InvalidKey):
            parse_block_key(key)


@given(
    value=st.from_regex(HEADER_PATTERNS[CHECKSUM_HEADER]).filter(
        lambda v: _matches(HEADER_PATTERNS[CHECKSUM_HEADER], v)
    )
)
@settings(max_examples=200, deadline=None)
def test_a_checksum_header_the_spec_generates_parses(value: str) -> None:
    assert parse_checksum(value).header == value


@pytest.mark.parametrize(
    "value",
    [
        "crc64nvme=AAAAAAAAAAB=",  # the unused bits of the last character set: not canonical base64
        "sha256=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAB=",
        "crc64nvme=AAAAAAAAAAAAAAA=",  # 11 bytes
        "crc32=AAAAAA==",  # an algorithm kvgate does not speak
        "crc64nvme=AAAAAAAAAAA",
    ],
)
def test_a_checksum_outside_the_pattern_is_refused(value: str) -> None:
    """The pattern and the parser agree: what one refuses the other does (negative_data_rejection)."""
    assert not _matches(HEADER_PATTERNS[CHECKSUM_HEADER], value)
    with pytest.raises(MalformedHeader):
        parse_checksum(value)


@pytest.mark.parametrize("value", ["bytes=-", "bytes=", "bytes=1-2,3-4", "bytes=-0x1"])
def test_a_range_outside_the_pattern_is_refused(value: str) -> None:
    assert not _matches(HEADER_PATTERNS["Range"], value)
    with pytest.raises(MalformedHeader):
        parse_range(value, size=100)


@given(value=st.from_regex(HEADER_PATTERNS["Range"]).filter(lambda v: _matches(HEADER_PATTERNS["Range"], v)))
@settings(max_examples=200, deadline=None)
def test_a_range_the_spec_generates_is_well_formed(value: str) -> None:
    """Every Range the pattern takes parses, or selects nothing of the object (a 416, never a 400)."""
    with contextlib.suppress(RangeNotSatisfiable):
        parse_range(value, size=100)


def test_the_events_inputs_have_their_grammar(spec: dict[str, Any]) -> None:
    """The events' namespace filter and Last-Event-ID are parsed as a namespace and a sequence number: the spec says
    so (a random string was a positive case and a 400)."""
    assert _param(spec, "/v1/events", "get", "namespace")["pattern"] == NAMESPACE_PATTERN
    assert _param(spec, "/v1/events", "get", "Last-Event-ID")["pattern"] == HEADER_PATTERNS["Last-Event-ID"]


def test_the_spec_links_operations_on_one_resource(spec: dict[str, Any]) -> None:
    """A stored block links to its GET, HEAD and DELETE by the same path, a deleted one to its GET and HEAD, a stored
    config to its GET: schemathesis' stateful phase chains them (use_after_free, ensure_resource_availability)."""
    ids = {op["operationId"]: (path, m) for path, ops in spec["paths"].items() for m, op in ops.items()}
    block = spec["paths"]["/v1/blocks/{path}"]
    for status in ("200", "201"):
        links = block["put"]["responses"][status]["links"]
        assert {ids[link["operationId"]] for link in links.values()} == {
            ("/v1/blocks/{path}", m) for m in ("get", "head", "delete")
        }
        assert all(link["parameters"] == {"path": "$request.path.path"} for link in links.values())
    deleted = block["delete"]["responses"]["204"]["links"]
    assert {ids[link["operationId"]][1] for link in deleted.values()} == {"get", "head"}
    config = spec["paths"]["/v1/namespaces/{namespace}/config"]["put"]["responses"]["201"]["links"]
    assert [ids[link["operationId"]] for link in config.values()] == [("/v1/namespaces/{namespace}/config", "get")]


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
