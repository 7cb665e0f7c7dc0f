"""The OpenAPI spec as the edge really answers: the statuses the limits add, and the bearer scheme with 401/403
on every operation that needs a token (the role each needs comes from the auth table itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from app.api.middleware.auth import required_role
from app.api.middleware.limits import UPLOAD_PREFIX
from app.config import Settings


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


def install(app: FastAPI, settings: Settings) -> None:
    extend_openapi(app, document_limits)
    extend_openapi(app, lambda spec: secure_spec(spec, metrics_public=settings.metrics_public))
