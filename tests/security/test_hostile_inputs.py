"""No input reaches a 5xx: every operation of the gateway's own OpenAPI spec, driven with hostile path parameters,
query parameters, headers and bodies against a real gateway process, gets an answer below 500, and the data that
was there before is intact after.

Hostile means what broke parsers before: digits ``int()`` takes and the grammar does not ('²', Arabic-Indic
digits), numbers past every bound, JSON nested thousands deep, NUL and other control bytes, non-ASCII and
over-long values, empty values, and grammar fragments (``tokens=``, ``parent=``, ``bytes=``) around all of those.
Requests go out as raw HTTP/1.1 on a fresh connection each, so nothing is cleaned up by a client library on the way;
only the status line is read (``GET /v1/events`` streams). The run prints how many requests each route got.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TEST_NS, key_for, matches, random_bytes, sha
from tests.gateway import Gateway, free_port
from tests.security.conftest import OTHER_NS, TOKENS, bearer, tokens_json
from tests.security.raw_http import build, encode_header, send_raw
from tests.security.test_auth_matrix import FIELDS

EXAMPLES = int(os.environ.get("KVGATE_HOSTILE_EXAMPLES", "100"))
PER_FIELD = EXAMPLES // 2
"""Requests per operation (hypothesis examples): EXAMPLES, and PER_FIELD more for each parameter and body."""

SEEDED = {key_for(i): random_bytes(3000 + i, 100 + i) for i in range(1, 5)}
"""The data that must come through intact: blocks of TEST_NS (never named by a generated request) and its config."""

DIGITS = ["²", "³", "١٢٣", "٣", "߁", "𝟗", "½", "Ⅻ", "0x10", "1_000", "1e3", "12.0", " 7", "-1", "+1", "-0", "00"]  # noqa: RUF001
HUGE = ["9" * 19, "9" * 40, "9" * 4301, "18446744073709551616", str(2**63), "1" + "0" * 400]
CONTROL = ["\x00", "a\x00b", "\x7f", "\x01", "\t", "\x1b[31m", "\ufeff", "\u202e", "\ud7ff", "é", "ß", "ı", "\u3000"]  # noqa: RUF001
SHAPES = ["", " ", ";", ",", "=", "*", "-", "/", "..", "%00", "%", "%zz", '"', "'", "\\", "{", "[", "null", "true"]
LONG = ["a" * 5000, "9" * 70000, "é" * 3000, "/".join(["ab"] * 600)]
ATOMS = DIGITS + HUGE + CONTROL + SHAPES + LONG
VALID_KEY = key_for(9, namespace=OTHER_NS)


def _mutated_key(atom: str, where: int) -> str:
    """A valid key of OTHER_NS with ``atom`` put in at a position."""
    at = where % (len(VALID_KEY) + 1)
    return VALID_KEY[:at] + atom + VALID_KEY[at:]


atoms = st.sampled_from(ATOMS)
texts = st.one_of(atoms, st.text(max_size=40), st.builds(lambda a, b: a + b, atoms, atoms))
numbers_ish = st.one_of(
    st.sampled_from(DIGITS[:5]),  # digits int() may take or refuse, that no ASCII grammar takes
    st.sampled_from(DIGITS + HUGE),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
)


def grammar(*prefixes: str) -> st.SearchStrategy[str]:
    """A header value in (or near) kvgate's grammar with hostile pieces: mostly a known prefix and numbers."""
    prefix = st.sampled_from(prefixes)
    return st.one_of(
        texts,
        st.builds(lambda p, a: p + a, prefix, texts),
        st.builds(lambda p, a: p + a, prefix, numbers_ish),
        st.builds(lambda p, a, b: f"{p}{a},{b}", prefix, numbers_ish, numbers_ish),
        st.builds(lambda p, a, b: f"{p}{a}-{b}", prefix, numbers_ish, numbers_ish),
        st.builds(lambda p, a, b: f"{p}{a}-{b}/{a}", prefix, numbers_ish, numbers_ish),
    )


HEADER_VALUES: dict[str, st.SearchStrategy[str]] = {
    "range": grammar("bytes=", "bytes=0-", "bytes=-", "BYTES=", "items="),
    "content-range": grammar("bytes ", "bytes 0-", "bytes */"),
    "x-kvgate-block-meta": grammar("tokens=", "parent=", "tokens=1,", "parent=00; tokens=", "tokens=1;parent="),
    "last-event-id": st.one_of(numbers_ish, texts),
    "if-none-match": st.one_of(st.just("*"), texts),
    "x-kvgate-sha256": st.one_of(texts, st.just("a" * 64), st.just("²" * 64)),
    "x-kvgate-part-sha256": st.one_of(texts, st.just("b" * 64)),
    "x-kvgate-checksum": st.one_of(texts, st.just("crc64nvme=AAAAAAAAAAA="), st.just("sha256=" + "²" * 43 + "=")),
    "x-kvgate-part-checksum": st.one_of(texts, st.just("crc64nvme=" + "A" * 400)),
    "content-type": st.one_of(st.just("application/json"), texts),
    "authorization": st.one_of(texts, st.builds(lambda a: "Bearer " + a, texts)),
    "accept-encoding": texts,
}


def path_values(name: str) -> st.SearchStrategy[str]:
    """Half the time a valid value (so the request gets past the route's key check to its headers and body)."""
    if name == "path":
        hostile = st.one_of(texts, st.builds(_mutated_key, atoms, st.integers(0, 200)))
        return st.one_of(st.just(VALID_KEY), hostile)
    return st.one_of(st.just(OTHER_NS), texts, st.builds(lambda a: OTHER_NS + a, atoms))


def deep(depth: int, *, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)


json_scalars = st.one_of(
    st.sampled_from(ATOMS), st.integers(), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=30)
)
json_docs = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
raw_json_bodies = st.one_of(
    json_docs.map(lambda d: json.dumps(d, allow_nan=True)),
    st.builds(
        lambda d, k: deep(d, kind=k), st.sampled_from([50, 999, 1001, 5000, 100_000]), st.sampled_from(["list", "dict"])
    ),
    st.builds(lambda d: '{"keys": ' + deep(d, kind="list") + "}", st.sampled_from([3, 1000, 50_000])),
    st.builds(lambda ks: json.dumps({"keys": ks}), st.lists(st.one_of(texts, st.just(VALID_KEY)), max_size=6)),
    st.sampled_from(["", "{", "[", '{"keys": [', '{"keys": ["' + "a" * 9000 + '"]}', "1" * 5000, '{"keys":1e999}']),
    st.builds(lambda n: '{"keys": [' + n + "]}", st.sampled_from(HUGE)),
    st.builds(lambda f: json.dumps(f), st.just(FIELDS)),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
)


@dataclass
class Outcome:
    statuses: Counter[int] = field(default_factory=Counter)
    per_route: Counter[str] = field(default_factory=Counter)
    bad: list[tuple[str, int, bytes]] = field(default_factory=list)


def quote_path(value: str, *, raw: bool) -> str:
    """A path segment as it goes on the request line: percent-encoded (``raw``: only what breaks the line)."""
    if raw:
        return value.replace(" ", "%20").replace("\r", "%0D").replace("\n", "%0A")
    return quote(value, safe="/")


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    params: tuple[tuple[str, str], ...]
    body: str | None


def operations(spec: dict[str, Any]) -> list[Operation]:
    ops = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            params = tuple((p["in"], p["name"]) for p in op.get("parameters", []))
            content = list(op.get("requestBody", {}).get("content", {}))
            ops.append(Operation(method.upper(), path, params, content[0] if content else None))
    # the routes outside the spec: the spec itself, the docs pages and their assets
    ops += [Operation("GET", p, (), None) for p in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect")]
    ops.append(Operation("GET", "/docs/assets/{asset}", (("path", "asset"),), None))
    return ops


def _valid_path_value(name: str) -> str:
    return VALID_KEY if name == "path" else OTHER_NS if name == "namespace" else "swagger-ui.css"


@st.composite
def requests(draw: st.DrawFn, op: Operation, *, focused: bool) -> tuple[bytes, str]:
    """A hostile request for ``op``. ``focused``: one field hostile, everything else valid (an admin token, a valid
    key, a sound Content-Length), so the hostile value reaches the parser deepest in the handler; else anything
    goes, all at once."""
    fields = [f"{where}:{name}" for where, name in op.params] + (["body"] if op.body else [])
    target_field = draw(st.sampled_from(fields)) if focused and fields else None

    def hostile(field: str) -> bool:
        return field == target_field if focused else True

    target = op.path
    raw = draw(st.booleans())
    for where, name in op.params:
        if where == "path":
            value = draw(path_values(name)) if hostile(f"path:{name}") else _valid_path_value(name)
            target = target.replace("{" + name + "}", quote_path(value, raw=raw))
    query = [
        f"{name}={quote(draw(st.one_of(numbers_ish, texts)), safe='')}"
        for where, name in op.params
        if where == "query" and hostile(f"query:{name}") and (focused or draw(st.booleans()))
    ]
    if query:
        target += "?" + "&".join(query)
    who = "admin" if focused else draw(st.sampled_from(["admin", "admin", "admin", "other", "none"]))
    headers: list[tuple[str, bytes]] = []
    if who != "none":
        headers.append(("Authorization", f"Bearer {TOKENS[who]}".encode()))
    declared = sorted({name.lower() for where, name in op.params if where == "header"} & set(HEADER_VALUES))
    if focused:
        chosen = {name for name in declared if target_field == f"header:{name}"}
    else:
        chosen = {name for name in declared if draw(st.integers(0, 3))}  # each declared header 3 times in 4
        chosen |= draw(st.sets(st.sampled_from(sorted(HEADER_VALUES)), max_size=2))
    for name in sorted(chosen):
        if name == "authorization" and who != "none":
            continue
        headers.append((name, encode_header(draw(HEADER_VALUES[name]))))
    body = b""
    if op.body == "application/json":
        body = draw(raw_json_bodies) if hostile("body") else json.dumps({"keys": [VALID_KEY]})
        body = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        headers.append(("Content-Type", b"application/json"))
    elif op.body is not None:
        body = draw(st.one_of(st.binary(max_size=256), st.just(random_bytes(4096, 9))))
    length = None if focused else draw(st.sampled_from([None, None, None, None, b"\xc2\xb2", b"9" * 30, b"-1"]))
    return build(op.method, target, headers, body, length=length), target[:120]


def drive(op: Operation, *, port: int, out: Outcome) -> None:
    """Send hostile requests for one operation (a third with everything hostile, the rest with one
    hostile field each), and note each answer."""
    route = f"{op.method} {op.path}"
    examples = EXAMPLES + PER_FIELD * (len(op.params) + (op.body is not None))

    @given(req=st.one_of(requests(op, focused=False), requests(op, focused=True), requests(op, focused=True)))
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def one(req: tuple[bytes, str]) -> None:
        status, head = send_raw(port, req[0])
        out.statuses[status] += 1
        out.per_route[route] += 1
        if status >= 500 or status == 0:
            out.bad.append((f"{route} {req[1]!r}", status, head + b" | " + req[0][:400]))

    one()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    env = {
        "KVGATE_TOKENS": tokens_json(),
        "KVGATE_EVENTS_ENABLED": "true",
        "KVGATE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "KVGATE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "KVGATE_MAX_HEADER_BYTES": "16384",
        "KVGATE_HEADER_TIMEOUT_S": "20",
    }
    gw = Gateway(tmp_path_factory.mktemp("hostile") / "data", env=env).start()
    with httpx.Client(base_url=gw.url, headers=bearer("admin"), timeout=30) as c:
        assert c.put(f"/v1/namespaces/{TEST_NS}/config", json=FIELDS).status_code == 201
        for key, data in SEEDED.items():
            assert c.put(f"/v1/blocks/{key}", content=data, headers={"X-KVGate-SHA256": sha(data)}).status_code == 201
    yield gw
    gw.stop()


def test_no_input_reaches_a_5xx(gateway: Gateway) -> None:
    spec = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    ops = operations(spec)
    assert len(ops) >= 18
    out = Outcome()
    for op in ops:
        drive(op, port=gateway.port, out=out)
    print("\nhostile requests per route:")
    for route, n in sorted(out.per_route.items()):
        print(f"  {n:5d}  {route}")
    print(f"statuses: {dict(sorted(out.statuses.items()))}; total {sum(out.per_route.values())}")
    assert all(out.per_route[f"{op.method} {op.path}"] >= EXAMPLES for op in ops)
    assert out.bad == [], "\n".join(repr(b)[:700] for b in out.bad[:20])
    assert gateway.proc is not None and gateway.proc.poll() is None
    # the data that was there before is intact: every block's bytes and ETag, the config, the lookup
    with httpx.Client(base_url=gateway.url, headers=bearer("admin"), timeout=30) as c:
        for key, data in SEEDED.items():
            r = c.get(f"/v1/blocks/{key}")
            assert r.status_code == 200 and r.content == data and matches(r.headers["etag"], data), key
        assert c.get(f"/v1/namespaces/{TEST_NS}/config").json() == FIELDS
        found = c.post("/v1/lookup", json={"keys": list(SEEDED)}).json()
        assert found["prefix"] == len(SEEDED)
        assert c.get("/readyz").status_code == 200
