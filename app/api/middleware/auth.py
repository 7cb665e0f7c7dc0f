"""Bearer tokens with roles and namespace scopes, enforced by one ASGI layer for every route, present or future.

A request is classified by (method, route template) into the role it needs: ``None`` (open), ``read``, ``write`` or
``admin``. Data-plane routes are listed in :data:`RULES`; any other route is admin-only until it is classified
there, and a request that matches no route at all gets the strictest answer: admin, and refused to a token limited
to namespaces (deny by default). The route is found on the path the router itself matches, ``scope["path"]`` less
``scope["root_path"]`` (a mount point, ``--root-path``, a proxy's prefix), so no prefix can make a request look like
another route to auth than to the router. The namespaces a request touches come from the matched route's path
parameters (``path``: a block or config key, ``namespace``) and, for ``POST /v1/lookup``, from every key of the
body. A token limited to namespaces may touch only those; a route that touches no particular namespace is refused to
it.

Who the caller is comes from :mod:`app.api.middleware.principals` (bearer tokens) and
:mod:`app.api.middleware.cert_identity` (client certificates).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import response_for
from app.api.middleware.cert_identity import peer_cert
from app.api.middleware.limits import BodyGuard, BodyLimits
from app.api.middleware.principals import Principal, Principals, Role, principal_of
from app.api.routing import RouteShape, route_path, route_table
from app.config import Settings
from app.errors import Forbidden, KVGateError, Unauthorized
from contract import wire
from contract.keys import MAX_KEY_LEN, InvalidKey, parse_block_key, parse_config_key
from contract.wire import WireError

log = logging.getLogger("kvgate.auth")


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


def required_role(method: str, template: str | None, *, metrics_public: bool) -> Role | None:
    """The role a request needs; None: open to anyone. ``template`` None: no route matched: the strictest."""
    if template is None:
        return Role.admin
    if template in OPEN_PATHS or (template == "/metrics" and metrics_public):
        return None
    return RULES.get((method.upper(), template), Role.admin)


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
    """Namespaces of a JSON ``{"keys": [...]}`` body; None: not that shape. MalformedBody when it is not JSON, or
    nested deeper than any lookup is (contract.wire.parse_json)."""
    doc = wire.parse_json(body)
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return None
    return [namespace_of_key(k) for k in keys]


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bytes(value).decode("latin-1")
    return None


def identify(principals: Principals, scope: Scope) -> tuple[Principal | None, str]:
    """Who the request is: a bearer token's principal, else the verified client certificate's; None with the reason
    when neither is valid. Reads only ``scope["headers"]`` and the TLS extension (the HEAD lane calls it with the
    scope of a request whose path is not parsed yet)."""
    table = principals.table  # one reading: a reload in between changes nothing for this request
    header = _authorization(scope) or ""
    scheme, _, rest = header.partition(" ")
    if scheme.lower() == "bearer" and rest.strip():
        token = wire.parse_bearer(header)  # None unless RFC 6750's ASCII grammar: no principal
        return (table.tokens.authenticate(token) if token is not None else None), "the bearer token is not valid"
    spec, reason = table.certs.authenticate(peer_cert(scope))
    return (principal_of(spec) if spec is not None else None), reason


def may_read(principals: Principals | None, scope: Scope, namespace: str) -> bool:
    """Whether the request may read a block of ``namespace``, as :class:`AuthMiddleware` decides for
    ``GET``/``HEAD /v1/blocks/{path}`` (``principals`` None: auth is off)."""
    return _may(principals, scope, namespace, RULES[("HEAD", "/v1/blocks/{path}")])


def may_write(principals: Principals | None, scope: Scope, namespace: str) -> bool:
    """Whether the request may store a block of ``namespace``, as :class:`AuthMiddleware` decides for
    ``PUT /v1/blocks/{path}`` (``principals`` None: auth is off)."""
    return _may(principals, scope, namespace, RULES[("PUT", "/v1/blocks/{path}")])


def _may(principals: Principals | None, scope: Scope, namespace: str, need: Role) -> bool:
    if principals is None:
        return True
    principal, _ = identify(principals, scope)
    return (
        principal is not None
        and principal.role >= need
        and (principal.namespaces is None or namespace in principal.namespaces)
    )


class AuthMiddleware:
    """Authenticate and authorize every HTTP request before any route runs (and before a body is read); any other
    kind of connection (a websocket) is refused."""

    def __init__(self, app: ASGIApp, *, principals: Principals, settings: Settings) -> None:
        self.app = app
        self.principals = principals
        self.metrics_public = settings.metrics_public
        self.max_body = settings.max_lookup_keys * (MAX_KEY_LEN + 8) + 4096
        self.body_limits = BodyLimits.of(settings)
        self._routes: list[RouteShape] | None = None

    def _route(self, scope: Scope) -> tuple[str | None, dict[str, Any]]:
        """The template and path parameters of the route the router will pick (first full match, else partial)."""
        if self._routes is None:
            self._routes = route_table(scope["app"])
        partial: tuple[str | None, dict[str, Any]] | None = None
        path = route_path(scope)
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
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008})  # policy violation: no such route is served
            return
        method = scope["method"].upper()
        template, params = self._route(scope)
        need = required_role(method, template, metrics_public=self.metrics_public)
        if need is None:
            await self.app(scope, receive, send)
            return
        principal, reason = self._principal(scope)
        if principal is None:
            await response_for(Unauthorized(reason))(scope, receive, send)
            return
        if principal.role < need:
            await self._deny(scope, receive, send, principal, f"needs the {need.name} role")
            return
        if principal.namespaces is None:
            await self.app(scope, receive, send)
            return
        touched = _path_namespaces(params)
        if template is not None and (method, template) in BODY_KEYS_ROUTES:
            # read through the same guard as every body (rate, pauses, size), then handed on as it came
            guard = BodyGuard(scope, receive, send, limits=self.body_limits, max_bytes=self.max_body)
            try:
                body = await _read_body(guard.receive)
                touched = _body_namespaces(body)
            except (KVGateError, WireError) as exc:
                if guard.failure is None:
                    await response_for(exc)(scope, receive, send)
                return
            receive = _replay(body, receive)
        if touched is None:
            await self._deny(scope, receive, send, principal, "names no namespace it may touch")
            return
        for ns in touched:
            if ns is None or ns not in principal.namespaces:
                await self._deny(scope, receive, send, principal, f"touches namespace {ns or '(unknown)'!r}")
                return
        await self.app(scope, receive, send)

    def _principal(self, scope: Scope) -> tuple[Principal | None, str]:
        return identify(self.principals, scope)

    async def _deny(self, scope: Scope, receive: Receive, send: Send, who: Principal, why: str) -> None:
        path = route_path(scope)[:200]
        log.info("forbidden principal=%s method=%s path=%s: %s", who.name, scope["method"], path, why)
        await response_for(Forbidden(f"{who.name!r} may not do this: the request {why}"))(scope, receive, send)


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
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


def install(app: FastAPI, principals: Principals | None, settings: Settings) -> None:
    """Enforce the principals (None: auth is off, which ``kvgate serve`` allows on loopback only)."""
    if principals is not None:
        app.add_middleware(AuthMiddleware, principals=principals, settings=settings)
    else:
        log.warning("no tokens configured: authentication is off (loopback only)")
