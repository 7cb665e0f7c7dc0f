"""The OpenAPI spec as the edge really answers: what each input's grammar is (keys, namespaces, headers, bodies: from
the contract itself), the statuses the limits add, and, where tokens are configured, the bearer scheme with 401/403
on every operation that needs a token (the role each needs comes from the auth table itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from app.api.middleware.auth import required_role
from app.api.middleware.limits import UPLOAD_PREFIX
from app.config import Settings
from app.core.service import MAX_CONFIG_BYTES
from contract.keys import BLOCK_KEY_PATTERN, MAX_KEY_LEN, NAMESPACE_PATTERN, block_path, namespace_for
from contract.wire import HEADER_PATTERNS

_EXAMPLE_NS = namespace_for({"model_name": "meta-llama/Llama-3.1-8B", "tokens_per_hash": 16})
PATH_PARAMETERS: dict[str, dict[str, Any]] = {
    "path": {
        "type": "string",
        "pattern": BLOCK_KEY_PATTERN,
        "maxLength": MAX_KEY_LEN,
        "description": "a block key, vLLM's FileMapper's: `<namespace>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin`",
        "examples": [block_path(namespace=_EXAMPLE_NS, rank=0, block_hash=bytes(range(32)), group=0)],
    },
    "namespace": {
        "type": "string",
        "pattern": NAMESPACE_PATTERN,
        "description": "`<model name, '/' as '_'>_<12 hex of the fields' digest>`",
        "examples": [_EXAMPLE_NS],
    },
}
"""The path parameters' grammars (contract/keys.py), by name."""
_NOT_PARAMETERS = frozenset({"content-length"})
"""Headers the HTTP framing owns: not a parameter a client chooses (a request's Content-Length is its body's)."""


def describe_inputs(spec: dict[str, Any], *, max_lookup_keys: int, max_config_bytes: int) -> dict[str, Any]:
    """Every input as the gateway parses it: keys and namespaces with their patterns, headers with a grammar with
    theirs, no Content-Length parameter, the lookup's keys and the config's fields with their bounds."""
    for ops in spec.get("paths", {}).values():
        for op in ops.values():
            if not isinstance(op, dict) or "parameters" not in op:
                continue
            kept = []
            for param in op["parameters"]:
                name = param.get("name", "")
                if param.get("in") == "header" and name.lower() in _NOT_PARAMETERS:
                    continue
                if param.get("in") in ("path", "query") and name in PATH_PARAMETERS:
                    param["schema"] = PATH_PARAMETERS[name]
                elif param.get("in") == "header":
                    pattern = next((p for h, p in HEADER_PATTERNS.items() if h.lower() == name.lower()), None)
                    if pattern is not None:
                        param["schema"] = {"type": "string", "pattern": pattern, **_described(param["schema"])}
                kept.append(param)
            op["parameters"] = kept
    schemas = spec.get("components", {}).get("schemas", {})
    lookup = schemas.get("LookupRequest")
    if lookup is not None:
        keys = lookup["properties"]["keys"]
        keys["items"] = {k: v for k, v in PATH_PARAMETERS["path"].items() if k != "description"}
        keys["maxItems"] = max_lookup_keys
    config = spec.get("paths", {}).get("/v1/namespaces/{namespace}/config", {}).get("put")
    if config is not None:
        body = config["requestBody"]["content"]["application/json"]["schema"]
        body["required"] = ["model_name"]
        body["properties"] = {"model_name": {"type": "string", "minLength": 1, "examples": ["meta-llama/Llama-3.1-8B"]}}
        body["description"] = (
            f"{body.get('description', '')}: their digest must be the namespace's last 12 hex; at most "
            f"{max_config_bytes} bytes as stored"
        )
    return spec


def _described(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k in ("description", "title")}


def document_limits(spec: dict[str, Any]) -> dict[str, Any]:
    """Document the statuses the limits add: 408/413 on every operation with a body, 429 on block PUTs."""
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            if not isinstance(op, dict) or "requestBody" not in op:
                continue
            responses = op.setdefault("responses", {})
            responses.setdefault("408", {"description": "the body arrived too slowly", **ref})
            responses.setdefault("413", {"description": "the body is too large", **ref})
            if method == "put" and path.startswith(UPLOAD_PREFIX):
                responses.setdefault("429", {"description": "too many uploads in flight; see Retry-After", **ref})
    return spec


_BLOCK = "/v1/blocks/{path}"
_CONFIG = "/v1/namespaces/{namespace}/config"
_NAMESPACE = "/v1/namespaces/{namespace}"
LINKS: dict[tuple[str, str], tuple[tuple[str, ...], dict[str, tuple[str, str]], dict[str, str]]] = {
    (_BLOCK, "put"): (
        ("200", "201"),
        {"Get": (_BLOCK, "get"), "Head": (_BLOCK, "head"), "Delete": (_BLOCK, "delete")},
        {"path": "$request.path.path"},
    ),
    (_BLOCK, "delete"): (("204",), {"Get": (_BLOCK, "get"), "Head": (_BLOCK, "head")}, {"path": "$request.path.path"}),
    (_CONFIG, "put"): (("200", "201"), {"Get": (_CONFIG, "get")}, {"namespace": "$request.path.namespace"}),
    (_NAMESPACE, "delete"): (("200",), {"Get": (_NAMESPACE, "get")}, {"namespace": "$request.path.namespace"}),
}
"""OpenAPI links between operations on one resource, for clients that chain them (schemathesis' stateful phase):
a stored block can be read, probed and deleted by the same path, a deleted one is then a miss; a stored config is
read back by its namespace; a purged namespace is then a miss. Keyed by (path, method): (the statuses that carry
the links, each link's name and target, the target's parameters as runtime expressions)."""


def link_operations(spec: dict[str, Any]) -> dict[str, Any]:
    """Add :data:`LINKS` to the responses of the operations the spec has."""
    paths = spec.get("paths", {})
    for (path, method), (statuses, targets, parameters) in LINKS.items():
        source = paths.get(path, {}).get(method)
        found = {name: paths.get(p, {}).get(m, {}).get("operationId") for name, (p, m) in targets.items()}
        if source is None:
            continue
        for status in statuses:
            response = source.get("responses", {}).get(status)
            if response is None:
                continue
            response["links"] = {
                name: {"operationId": op_id, "parameters": dict(parameters)} for name, op_id in found.items() if op_id
            }
    return spec


def extend_openapi(app: FastAPI, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Post-process the generated spec once (chained: each call adds one edit)."""
    base = app.openapi
    done: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not done:
            done.append(edit(base()))
            app.openapi_schema = done[0]
        return done[0]

    app.openapi = openapi  # type: ignore[method-assign]


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


def install(app: FastAPI, settings: Settings, *, secured: bool) -> None:
    """The spec's edits; ``secured``: tokens are configured (else no operation needs one, and the spec says so)."""
    extend_openapi(
        app,
        lambda spec: describe_inputs(spec, max_lookup_keys=settings.max_lookup_keys, max_config_bytes=MAX_CONFIG_BYTES),
    )
    extend_openapi(app, document_limits)
    extend_openapi(app, link_operations)
    if secured:
        extend_openapi(app, lambda spec: secure_spec(spec, metrics_public=settings.metrics_public))
