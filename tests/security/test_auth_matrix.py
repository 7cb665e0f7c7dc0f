"""Every route x {no token, bad token, read, write, admin, other-namespace, namespace-scoped admin} -> status.

The matrix runs against a gateway served at the root, under a root path (``KVGATE_ROOT_PATH``, what a proxy that
strips a prefix needs), and under another ASGI server that sets the root path itself (uvicorn's ``--root-path``):
auth must answer the same everywhere, and a request that matches no route gets the strictest answer.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import TEST_NS, agnostic_fields, key_for, random_bytes
from tests.gateway import Gateway
from tests.security.conftest import OTHER_NS, TOKENS, bearer, start_secure, tokens_json

FIELDS = agnostic_fields(
    "test-org/test-model", dtype="bfloat16", groups=[{"tokens_per_block": 16, "layer_names": ["layer.0"]}]
)
KEY = key_for(1)
DATA = random_bytes(4096, 1)


@dataclass(frozen=True)
class Call:
    method: str
    url: str
    need: str | None  # None: open; else the least role
    ok: frozenset[int]  # statuses once allowed
    global_route: bool = False  # touches no one namespace: refused to namespace-limited tokens
    touches_none: bool = False  # names no namespace and reveals nothing of any: allowed to every role that may
    body: bytes | None = None
    json: object = None


CALLS = [
    Call("GET", "/healthz", None, frozenset({200})),
    Call("GET", "/readyz", None, frozenset({200})),
    Call("GET", "/openapi.json", None, frozenset({200})),
    Call("GET", "/docs", None, frozenset({200})),
    Call("GET", "/metrics", "admin", frozenset({200}), global_route=True),
    Call("GET", f"/v1/blocks/{KEY}", "read", frozenset({200})),
    Call("HEAD", f"/v1/blocks/{KEY}", "read", frozenset({200})),
    Call("PUT", f"/v1/blocks/{KEY}", "write", frozenset({200, 201}), body=DATA),
    Call("DELETE", f"/v1/blocks/{key_for(2)}", "admin", frozenset({204, 404})),
    Call("POST", "/v1/lookup", "read", frozenset({200}), json={"keys": [KEY, key_for(2)]}),
    Call("POST", "/v1/lookup", "read", frozenset({200}), touches_none=True, json={"keys": []}),
    Call("GET", f"/v1/namespaces/{TEST_NS}/config", "read", frozenset({200})),
    Call("PUT", f"/v1/namespaces/{TEST_NS}/config", "write", frozenset({200, 201}), json=FIELDS),
    Call("GET", "/v1/namespaces", "admin", frozenset({200}), global_route=True),
    Call("GET", f"/v1/namespaces/{TEST_NS}", "admin", frozenset({200})),
    Call("GET", "/v1/stats", "admin", frozenset({200}), global_route=True),
    Call("DELETE", f"/v1/namespaces/{OTHER_NS}", "admin", frozenset({200, 204, 404})),
    # deny by default: no route matched, so admin only, and refused to any token limited to namespaces
    Call("GET", "/v1/no-such-route", "admin", frozenset({404}), global_route=True),
    Call("DELETE", "/v2/blocks/x", "admin", frozenset({404}), global_route=True),
]
RANK = {"read": 1, "write": 2, "admin": 3}
WHO: dict[str, tuple[str | None, str | None, set[str] | None]] = {
    # who -> (token text, role, namespaces)
    "none": (None, None, None),
    "bad": ("not-a-token", None, None),
    "read": (TOKENS["read"], "read", None),
    "write": (TOKENS["write"], "write", None),
    "admin": (TOKENS["admin"], "admin", None),
    "other": (TOKENS["other"], "write", {OTHER_NS}),
    "scoped_admin": (TOKENS["scoped_admin"], "admin", {TEST_NS}),
}


def expected(call: Call, who: str) -> str:
    _token, role, namespaces = WHO[who]
    if call.need is None:
        return "ok"
    if role is None:
        return "401"
    if RANK[role] < RANK[call.need]:
        return "403"
    if namespaces is not None and not call.touches_none:
        if call.global_route:
            return "403"
        touched = OTHER_NS if OTHER_NS in call.url else TEST_NS
        if touched not in namespaces:
            return "403"
    return "ok"


class UvicornGateway(Gateway):
    """The app under uvicorn's own command line with ``--root-path``: an ASGI server that sets the root path in
    every scope, whatever kvgate's settings say."""

    def start(self, *, timeout_s: float = 90.0) -> Gateway:
        env = {**os.environ, "PYTHONPATH": str(self.cwd), "KVGATE_DATA_DIR": str(self.data_dir), **self.extra_env}
        argv = [sys.executable, "-m", "uvicorn", "--factory", "app.main:create_app", "--port", str(self.port)]
        self._spawn(
            [*argv, "--host", "127.0.0.1", "--root-path", "/mounted", "--log-level", "warning"],
            env=env,
            ready=lambda: httpx.get(f"{self.url}/readyz", headers=bearer("admin"), timeout=1.0).status_code == 200,
            timeout_s=timeout_s,
        )
        return self


SERVED = ["root", "root_path", "asgi_server_root_path"]


@pytest.fixture(scope="module", params=SERVED)
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    data = tmp_path_factory.mktemp("matrix") / "data"
    env = {"KVGATE_TOKENS": tokens_json()}
    if request.param == "root_path":
        gateway = Gateway(data, env={**env, "KVGATE_ROOT_PATH": "/kvgate"}).start()
    elif request.param == "asgi_server_root_path":
        gateway = UvicornGateway(data, env=env).start()
    else:
        gateway = start_secure(data)
    with httpx.Client(base_url=gateway.url, headers=bearer("admin")) as c:
        assert c.put(f"/v1/blocks/{KEY}", content=DATA).status_code == 201
        assert c.put(f"/v1/namespaces/{TEST_NS}/config", json=FIELDS).status_code == 201
    yield gateway
    gateway.stop()


@pytest.mark.parametrize("who", list(WHO))
@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c.method} {c.url[:40]}")
def test_matrix(gw: Gateway, call: Call, who: str) -> None:
    token = WHO[who][0]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.request(call.method, call.url, headers=headers, content=call.body, json=call.json)
    want = expected(call, who)
    if want == "ok":
        assert r.status_code in call.ok, (who, call, r.status_code, r.text[:300])
        return
    assert r.status_code == int(want), (who, call, r.status_code, r.text[:300])
    if call.method != "HEAD":
        assert r.json()["error"]["code"] == ("unauthorized" if want == "401" else "forbidden")
    if want == "401":
        assert r.headers["www-authenticate"].startswith("Bearer")


def test_refusals_changed_nothing(gw: Gateway) -> None:
    """Whatever the matrix refused (a DELETE by a read token among them) left the seeded block as it was."""
    with httpx.Client(base_url=gw.url, headers=bearer("admin"), timeout=30) as c:
        r = c.get(f"/v1/blocks/{KEY}")
        assert r.status_code == 200 and r.content == DATA


def test_scoped_tokens_stay_in_their_namespace(gw: Gateway) -> None:
    other_key = key_for(7, namespace=OTHER_NS)
    body = random_bytes(1000, 7)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        assert c.put(f"/v1/blocks/{other_key}", content=body, headers=bearer("other")).status_code == 201
        r = c.get(f"/v1/blocks/{other_key}", headers=bearer("other"))
        assert r.status_code == 200 and r.content == body
        # each lookup key is checked: one key of another namespace refuses the whole lookup
        assert c.post("/v1/lookup", json={"keys": [other_key]}, headers=bearer("other")).status_code == 200
        assert c.post("/v1/lookup", json={"keys": [other_key, KEY]}, headers=bearer("other")).status_code == 403
        assert c.post("/v1/lookup", json={"keys": [KEY, other_key]}, headers=bearer("scoped_admin")).status_code == 403
        # the namespace-limited admin may purge its own namespace only, and not read another's block
        assert c.get(f"/v1/blocks/{other_key}", headers=bearer("scoped_admin")).status_code == 403
        assert c.delete(f"/v1/blocks/{other_key}", headers=bearer("scoped_admin")).status_code == 403
        # a key that names no namespace is refused to a scoped token, not passed on
        assert c.get("/v1/blocks/garbage", headers=bearer("other")).status_code == 403
        assert c.get(f"/v1/blocks/{other_key}", headers=bearer("admin")).content == body


def test_wrong_scheme_and_empty_token_are_401(gw: Gateway) -> None:
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for value in (f"Basic {TOKENS['admin']}", "Bearer", TOKENS["admin"], f"Bearer {TOKENS['admin']}x"):
            r = c.get("/v1/stats", headers={"Authorization": value})
            assert r.status_code == 401, value


def test_metrics_public_setting(tmp_path: Path) -> None:
    gw = start_secure(tmp_path / "data", KVGATE_METRICS_PUBLIC="true")
    try:
        assert httpx.get(f"{gw.url}/metrics").status_code == 200
        assert httpx.get(f"{gw.url}/v1/stats").status_code == 401
    finally:
        gw.stop()


def test_tokens_file_toml(tmp_path: Path) -> None:
    import json

    entries = json.loads(tokens_json())
    lines = []
    for e in entries:
        ns = "" if "namespaces" not in e else f"namespaces = {json.dumps(e['namespaces'])}\n"
        lines.append(f'[[tokens]]\nname = "{e["name"]}"\nsha256 = "{e["sha256"]}"\nrole = "{e["role"]}"\n{ns}')
    path = tmp_path / "tokens.toml"
    path.write_text("\n".join(lines))
    gw = Gateway(tmp_path / "data", env={"KVGATE_TOKENS_FILE": str(path)}).start()
    try:
        assert httpx.get(f"{gw.url}/v1/stats").status_code == 401
        assert httpx.get(f"{gw.url}/v1/stats", headers=bearer("read")).status_code == 403
        assert httpx.get(f"{gw.url}/v1/stats", headers=bearer("admin")).status_code == 200
    finally:
        gw.stop()


def test_spec_shows_bearer_scheme_on_protected_operations() -> None:
    from app.config import Settings
    from app.main import create_app

    spec = create_app(Settings(tokens=json.loads(tokens_json()))).openapi()
    assert spec["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": spec["components"]["securitySchemes"]["bearer"]["description"],
    }
    ops = {(p, m): op for p, item in spec["paths"].items() for m, op in item.items()}
    for (path, method), op in ops.items():
        open_route = path in ("/healthz", "/readyz")
        assert ("security" in op) != open_route, (path, method)
        if not open_route:
            assert op["security"] == [{"bearer": []}] and {"401", "403"} <= set(op["responses"])
    assert ops[("/v1/blocks/{path}", "put")]["x-kvgate-role"] == "write"
    assert ops[("/v1/blocks/{path}", "delete")]["x-kvgate-role"] == "admin"
    assert ops[("/v1/lookup", "post")]["x-kvgate-role"] == "read"


def test_spec_declares_no_security_without_tokens() -> None:
    """Auth off (no tokens, loopback only): no operation needs a token, so the spec asks for none (it declared the
    bearer scheme on every operation, and a client generated from it sent a token it did not have)."""
    from app.config import Settings
    from app.main import create_app

    spec = create_app(Settings(tokens=[])).openapi()
    assert "securitySchemes" not in spec.get("components", {})
    for path, item in spec["paths"].items():
        for method, op in item.items():
            assert "security" not in op and "x-kvgate-role" not in op, (path, method)
