"""ONE table: error type -> (HTTP status, error code), for the domain's errors (app.errors) and the contract's
(contract.keys, contract.wire) alike; nothing in app/api translates one error into another by hand. Every error body
is {"error": {code, message}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app import errors as e
from app.api.routing import RouteShape, allowed_methods, route_path, route_table
from contract.keys import InvalidKey
from contract.wire import MalformedHeader, WireError, unsatisfied_content_range

log = logging.getLogger("kvgate.api")

RETRY_AFTER_S = "1"

ERROR_TABLE: dict[type[Exception], tuple[int, str]] = {
    e.InvalidRequest: (400, "invalid_request"),
    InvalidKey: (400, "invalid_request"),
    MalformedHeader: (400, "invalid_request"),
    WireError: (400, "invalid_request"),
    e.DigestMismatch: (400, "digest_mismatch"),
    e.SizeMismatch: (400, "size_mismatch"),
    e.Unauthorized: (401, "unauthorized"),
    e.Forbidden: (403, "forbidden"),
    e.BlockNotFound: (404, "not_found"),
    e.NamespaceNotFound: (404, "namespace_not_found"),
    e.CorruptData: (404, "corrupt_data"),
    e.EventsDisabled: (404, "events_disabled"),
    e.Conflict: (409, "conflict"),
    e.LengthRequired: (411, "length_required"),
    e.RequestTimeout: (408, "request_timeout"),
    e.PreconditionFailed: (412, "precondition_failed"),
    e.PayloadTooLarge: (413, "payload_too_large"),
    e.RangeNotSatisfiable: (416, "range_not_satisfiable"),
    e.LayoutMismatch: (422, "layout_mismatch"),
    e.TooManyRequests: (429, "too_many_requests"),
    e.HeadersTooLarge: (431, "headers_too_large"),
    e.VersionMismatch: (503, "version_in_flux"),
    e.BackendUnavailable: (503, "backend_unavailable"),
    e.IndexUnavailable: (503, "index_unavailable"),
    e.InsufficientStorage: (507, "insufficient_storage"),
}


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


STATUS_CODES: dict[int, str] = {status: code for status, code in ERROR_TABLE.values()}
"""Status -> one of its codes, for documenting responses in the OpenAPI spec."""


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def lookup(exc: Exception) -> tuple[int, str]:
    for klass in type(exc).__mro__:
        if klass in ERROR_TABLE and issubclass(klass, Exception):
            return ERROR_TABLE[klass]
    return 500, "internal_error"


def response_for(exc: Exception) -> JSONResponse:
    status, code = lookup(exc)
    headers: dict[str, str] = {}
    if status in (429, 503):
        headers["Retry-After"] = RETRY_AFTER_S
    if isinstance(exc, e.RangeNotSatisfiable):
        headers["Content-Range"] = unsatisfied_content_range(exc.size)
    if isinstance(exc, e.Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="kvgate"'
    if status >= 500:
        log.warning("request failed status=%s code=%s error=%s", status, code, exc)
    return JSONResponse(error_body(code, str(exc) or code), status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    routes: list[RouteShape] = []
    """The app's routes, read at the first 405 (every route is added by then)."""

    async def on_domain(_: Request, exc: Exception) -> JSONResponse:
        return response_for(exc)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404 and request.url.path.startswith("/v1/blocks/"):
            # the router matched no route: the key has characters no route takes (a newline, ...), a bad key
            return response_for(e.InvalidRequest("not a block key"))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # every method of the resource, not only the first matching route's
            routes[:] = routes or route_table(request.app)
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(routes, route_path(request.scope)))}
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=headers)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse(error_body("validation_error", f"{where}: {first.get('msg', 'invalid')}"), status_code=422)

    async def on_disconnect(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body("client_disconnected", "client went away mid-request"), status_code=400)

    for klass in ERROR_TABLE:  # each table entry answered from the table, wherever a route raises it
        app.add_exception_handler(klass, on_domain)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ClientDisconnect, on_disconnect)


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the error statuses a route can return."""
    return {s: {"description": STATUS_CODES.get(s, "error"), "model": ErrorResponse} for s in statuses}
