"""Bearer tokens with roles and namespace scopes, enforced by one ASGI layer for every route, present or future.

A request is classified by (method, route template) into the role it needs: ``None`` (open), ``read``, ``write``
or ``admin``. Data-plane routes are listed in :data:`RULES`; any other route is admin-only until it is classified
there (deny by default). The namespaces a request touches come from the matched route's path parameters
(``path``: a block or config key, ``namespace``) and, for ``POST /v1/lookup``, from every key of the body. A token
limited to namespaces may touch only those; a route that touches no particular namespace is refused to it.

Tokens are kept as sha256 digests and compared with :func:`hmac.compare_digest` against every entry.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import TypeAdapter, ValidationError
from starlette.convertors import Convertor
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.cert_identity import CertPrincipals
from app.api.errors import response_for
from app.api.limits import extend_openapi
from app.api.tls import peer_cert
from app.config import Settings, TokenSpec
from app.errors import Forbidden, PayloadTooLarge, Unauthorized
from contract.keys import MAX_KEY_LEN, InvalidKey, parse_block_key, parse_config_key, parse_namespace

log = logging.getLogger("kvgate.auth")


class Role(IntEnum):
    read = 1
    write = 2
    admin = 3


OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/docs/assets/{asset}", "/redoc"}
)

RULES: dict[tuple[str, str], Role] = {
    ("GET", "/v1/blocks/{path}"): Role.read,
    ("HEAD", "/v1/blocks/{path}"): Role.read,
    ("PUT", "/v1/blocks/{path}"): Role.write,
    ("DELETE", "/v1/blocks/{path}"): Role.admin,
    ("POST", "/v1/lookup"): Role.read,
    ("GET", "/v1/namespaces/{namespace}/config"): Role.read,
    ("HEAD", "/v1/namespaces/{namespace}/config"): Role.read,
    ("PUT", "/v1/namespaces/{namespace}/config"): Role.write,
}
"""The data plane. Everything else (admin routes, /metrics unless public, unknown routes) needs ``admin``."""

BODY_KEYS_ROUTES = frozenset({("POST", "/v1/lookup")})
"""Routes whose JSON body ``{"keys": [...]}`` names the keys they touch (each one is checked)."""

_CONVERTER = re.compile(r"\{(\w+):\w+\}")


def template_of(path: str) -> str:
    """A route's path with converters dropped: ``/v1/blocks/{path:path}`` -> ``/v1/blocks/{path}``."""
    return _CONVERTER.sub(r"{\1}", path)


def required_role(method: str, template: str | None, *, metrics_public: bool) -> Role | None:
    """The role a request needs; None: open to anyone. ``template`` None: no route matched (a 404 follows)."""
    if template is None:
        return Role.read
    if template in OPEN_PATHS or (template == "/metrics" and metrics_public):
        return None
    return RULES.get((method.upper(), template), Role.admin)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    role: Role
    namespaces: frozenset[str] | None
    """None: every namespace."""


def principal_of(spec: TokenSpec) -> Principal:
    return Principal(
        name=spec.name,
        role=Role[spec.role],
        namespaces=None if spec.namespaces is None else frozenset(spec.namespaces),
    )


class TokenTable:
    """Presented token -> Principal, by sha256 digest, compared in constant time with every entry."""

    def __init__(self, specs: Iterable[TokenSpec]) -> None:
        self._entries = [(spec.sha256.lower().encode(), principal_of(spec)) for spec in specs if spec.sha256]

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, token: str) -> Principal | None:
        digest = hash_token(token).encode()
        found: Principal | None = None
        for stored, principal in self._entries:  # no early exit: the time does not depend on which one matched
            if hmac.compare_digest(digest, stored):
                found = principal
        return found


_TOKEN_LIST = TypeAdapter(list[TokenSpec])


def read_tokens_file(path: Path) -> list[TokenSpec]:
    """A JSON list (or ``{"tokens": [...]}``) or a TOML file of ``[[tokens]]`` tables."""
    text = path.read_text()
    raw: Any = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    if isinstance(raw, dict):
        raw = raw.get("tokens", [])
    try:
        return _TOKEN_LIST.validate_python(raw)
    except ValidationError as exc:
        raise ValueError(f"tokens file {path}: {exc}") from exc


def load_tokens(settings: Settings) -> list[TokenSpec]:
    specs = list(settings.tokens)
    if settings.tokens_file is not None:
        specs += read_tokens_file(settings.tokens_file)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("token names must be unique")
    for spec in specs:
        try:
            CertPrincipals([spec])
        except ValueError as exc:
            raise ValueError(f"token {spec.name!r}: {exc}") from exc
        for ns in spec.namespaces or ():
            try:
                parse_namespace(ns)
            except InvalidKey as exc:
                raise ValueError(f"token {spec.name!r}: {exc}") from exc
    return specs


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(settings: Settings) -> None:
    """Refuse to serve a non-loopback address without principals (raises ValueError with the reason).

    The transport half of the rule (TLS) is :func:`app.api.tls.bind_warnings`.
    """
    if not is_loopback(settings.host) and not load_tokens(settings):
        raise ValueError(
            f"refusing to listen on {settings.host}: no tokens are configured, so anyone who can reach it could "
            "read and delete every block. Set KVGATE_TOKENS or KVGATE_TOKENS_FILE (see `kvgate token new`; an "
            "entry may name a client certificate instead), or bind 127.0.0.1."
        )


def namespace_of_key(key: str) -> str | None:
    for parse in (lambda k: parse_block_key(k).namespace, parse_config_key):
        try:
            return parse(key)
        except InvalidKey:
            continue
    return None


def _path_namespaces(params: dict[str, Any]) -> list[str | None] | None:
    """Namespaces named by path parameters; None: the route names none (a global route)."""
    found: list[str | None] = []
    if "path" in params:
        found.append(namespace_of_key(str(params["path"])))
    if "namespace" in params:
        found.append(str(params["namespace"]))
    return found or None


def _body_namespaces(body: bytes) -> list[str | None] | None:
    """Namespaces of a JSON ``{"keys": [...]}`` body; None: not that shape (the route rejects it itself)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return None
    return [namespace_of_key(k) for k in keys]


@dataclass(frozen=True, slots=True)
class RouteShape:
    template: str
    methods: frozenset[str]
    regex: re.Pattern[str]
    convertors: dict[str, Convertor[Any]]


def route_table(app: Any) -> list[RouteShape]:
    """Every route of ``app``, flattened through included routers, with its compiled path.

    FastAPI may keep included routers as lazy branches; ``fastapi.routing.iter_route_contexts`` flattens them
    (older versions keep a flat ``app.routes`` of Starlette routes, which the fallback reads).
    """
    try:
        from fastapi.routing import iter_route_contexts

        flat: list[Any] = list(iter_route_contexts(app.routes))
    except ImportError:
        flat = list(app.routes)
    shapes: list[RouteShape] = []
    for route in flat:
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if not isinstance(path, str):
            continue
        regex, _fmt, convertors = compile_path(path)
        allowed = set(methods or ())
        if "GET" in allowed:
            allowed.add("HEAD")
        shapes.append(RouteShape(template_of(path), frozenset(allowed), regex, convertors))
    return shapes


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class AuthMiddleware:
    """Authenticate and authorize every HTTP request before any route runs (and before a body is read)."""

    def __init__(self, app: ASGIApp, *, tokens: TokenTable, certs: CertPrincipals, settings: Settings) -> None:
        self.app = app
        self.tokens = tokens
        self.certs = certs
        self.metrics_public = settings.metrics_public
        self.max_body = settings.max_lookup_keys * (MAX_KEY_LEN + 8) + 4096
        self._routes: list[RouteShape] | None = None

    def _route(self, scope: Scope) -> tuple[str | None, dict[str, Any]]:
        """The template and path parameters of the route the router will pick (first full match, else partial)."""
        if self._routes is None:
            self._routes = route_table(scope["app"])
        partial: tuple[str | None, dict[str, Any]] | None = None
        path = scope["path"]
        for route in self._routes:
            m = route.regex.match(path)
            if m is None:
                continue
            params = {k: route.convertors[k].convert(v) for k, v in m.groupdict().items()}
            found = (route.template, params)
            if scope["method"] in route.methods:
                return found
            partial = partial or found
        return partial or (None, {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"].upper()
        template, params = self._route(scope)
        need = required_role(method, template, metrics_public=self.metrics_public)
        if need is None:
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        if token is not None:
            principal, reason = self.tokens.authenticate(token), "the bearer token is not valid"
        else:
            principal, reason = self._cert_principal(scope)
        if principal is None:
            await response_for(Unauthorized(reason))(scope, receive, send)
            return
        if principal.role < need:
            await self._deny(scope, receive, send, principal, f"needs the {need.name} role")
            return
        if principal.namespaces is None or template is None:
            await self.app(scope, receive, send)
            return
        touched = _path_namespaces(params)
        if (method, template) in BODY_KEYS_ROUTES:
            try:
                body = await _read_body(receive, limit=self.max_body)
            except PayloadTooLarge as exc:
                await response_for(exc)(scope, receive, send)
                return
            receive = _replay(body, receive)
            touched = _body_namespaces(body) or []
        if touched is None:
            await self._deny(scope, receive, send, principal, "is not limited to a namespace")
            return
        for ns in touched:
            if ns is None or ns not in principal.namespaces:
                await self._deny(scope, receive, send, principal, f"touches namespace {ns or '(unknown)'!r}")
                return
        await self.app(scope, receive, send)

    def _cert_principal(self, scope: Scope) -> tuple[Principal | None, str]:
        """The principal the connection's verified client certificate names (a bearer token takes precedence)."""
        spec, reason = self.certs.authenticate(peer_cert(scope))
        return (principal_of(spec) if spec is not None else None), reason

    async def _deny(self, scope: Scope, receive: Receive, send: Send, who: Principal, why: str) -> None:
        log.info("forbidden principal=%s method=%s path=%s: %s", who.name, scope["method"], scope["path"][:200], why)
        await response_for(Forbidden(f"{who.name!r} may not do this: the request {why}"))(scope, receive, send)


async def _read_body(receive: Receive, *, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# -- OpenAPI ------------------------------------------------------------------------------------------------------

SCHEME = "bearer"
_AUTH_ERRORS = {
    "401": "no token, or not a valid one (WWW-Authenticate: Bearer)",
    "403": "the token's role or namespaces do not allow this",
}


def secure_spec(spec: dict[str, Any], *, metrics_public: bool) -> dict[str, Any]:
    """Add the HTTP bearer scheme, and apply it (with 401/403) to every operation that needs a token."""
    components = spec.setdefault("components", {})
    components.setdefault("securitySchemes", {})[SCHEME] = {
        "type": "http",
        "scheme": "bearer",
        "description": "a token from KVGATE_TOKENS / KVGATE_TOKENS_FILE (roles: read < write < admin)",
    }
    err_ref = {"$ref": "#/components/schemas/ErrorResponse"} if "ErrorResponse" in components.get("schemas", {}) else {}
    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            role = required_role(method, path, metrics_public=metrics_public)
            if role is None:
                continue
            op["security"] = [{SCHEME: []}]
            op["x-kvgate-role"] = role.name
            for status, text in _AUTH_ERRORS.items():
                entry: dict[str, Any] = {"description": text}
                if err_ref:
                    entry["content"] = {"application/json": {"schema": err_ref}}
                op["responses"].setdefault(status, entry)
    return spec


def install(app: FastAPI, settings: Settings) -> None:
    """Enforce tokens when any are configured (else auth is off: ``kvgate serve`` allows that on loopback only)."""
    specs = load_tokens(settings)
    if specs:
        app.add_middleware(AuthMiddleware, tokens=TokenTable(specs), certs=CertPrincipals(specs), settings=settings)
    else:
        log.warning("no tokens configured: authentication is off (loopback only)")
    extend_openapi(app, lambda spec: secure_spec(spec, metrics_public=settings.metrics_public))
