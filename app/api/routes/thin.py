"""A cheaper route class for the block data path: same endpoint, same OpenAPI entry, less per-request work.

FastAPI resolves every request's parameters through its general dependency solver (sub-dependency graph, exit
stacks, caches). The block routes only take a path, a few headers, the Request and dependencies of the form
``f(request) -> object`` (app.api.deps), so ``ThinRoute`` precomputes how to get each argument once, at start-up,
and builds the call with a dict lookup per argument. Header values still go through the field's own pydantic
validation, so errors are the same 422s. An endpoint with anything else (a body model, query parameters,
security, dependencies with their own parameters) falls back to FastAPI's handler unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def _header_name(field: Any) -> str:
    alias: str = field.alias
    if alias == field.name and getattr(field.field_info, "convert_underscores", True):
        alias = alias.replace("_", "-")
    return alias.lower()


def _simple_dependency(dep: Any) -> Callable[[Request], Any] | None:
    """``dep.call`` if it is a plain sync function of the request alone, else None."""
    call = dep.call
    if (
        call is None
        or dep.dependencies
        or dep.path_params
        or dep.query_params
        or dep.header_params
        or dep.cookie_params
        or dep.body_params
        or dep.request_param_name is None
        or dep.security_scopes_param_name is not None
        or inspect.iscoroutinefunction(call)
        or inspect.isgeneratorfunction(call)
        or not inspect.isfunction(call)
    ):
        return None
    return call


class ThinRoute(APIRoute):
    """An APIRoute whose handler binds path, header, Request and simple request dependencies directly."""

    def get_route_handler(self) -> Handler:
        d = self.dependant
        simple = [_simple_dependency(dep) for dep in d.dependencies]
        endpoint = d.call
        if (
            endpoint is None
            or not inspect.iscoroutinefunction(endpoint)
            or d.query_params
            or d.cookie_params
            or d.body_params
            or d.response_param_name
            or d.background_tasks_param_name
            or d.security_scopes_param_name
            or any(s is None for s in simple)
            or any(dep.name is None for dep in d.dependencies)
            or any(f.field_info.is_required() for f in d.header_params)
        ):
            return super().get_route_handler()
        deps = [(str(dep.name), s) for dep, s in zip(d.dependencies, simple, strict=True)]
        paths = [(f.name, f.alias) for f in d.path_params]
        headers = [(f.name, _header_name(f), f, f.get_default()) for f in d.header_params]
        request_name = d.request_param_name

        async def handler(request: Request) -> Response:
            kwargs: dict[str, Any] = {}
            for name, alias in paths:
                kwargs[name] = request.path_params[alias]
            if headers:
                # one pass over the raw headers (Starlette's Headers.get scans them all for every lookup)
                raw = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.scope["headers"]}
                errors: list[Any] = []
                for name, alias, field, default in headers:
                    value: str | None = raw.get(alias)
                    if value is None:
                        kwargs[name] = default
                        continue
                    kwargs[name], errs = field.validate(value, loc=("header", alias))
                    errors.extend(errs)
                if errors:
                    raise RequestValidationError(errors)
            for dep_name, call in deps:
                kwargs[dep_name] = call(request)  # type: ignore[misc]
            if request_name is not None:
                kwargs[request_name] = request
            response = await endpoint(**kwargs)
            if not isinstance(response, Response):
                raise TypeError(f"{endpoint.__name__} must return a Response to use ThinRoute")
            return response

        return handler


class BlockFastPath:
    """Pure-ASGI dispatch of the block data path straight to its ThinRoute handlers.

    ``routes``: the routes of an APIRouter included without extra prefix, dependencies or other context (the
    router's own routes are then the ones the app runs). Innermost of the app's middlewares (auth, limits and
    metrics still wrap it): a request whose path and method match one of them skips Starlette's router scan,
    FastAPI's per-request wrappers (exception wrapper, exit stack) and their send chains. It does what those do
    for these routes: the same path regex, the same ``scope`` entries (``route``, ``endpoint``, ``path_params``),
    and the app's own exception handlers (``app.exception_handlers``, looked up by the exception's MRO as
    Starlette does). Anything else, or a route ThinRoute could not make cheap, goes down the usual stack. Built for
    Starlette >=1.6,<2 and FastAPI <0.166 (pinned in pyproject.toml); tests/api/test_fast_path.py checks that the
    answers are the full stack's and that this path is the one taken.
    """

    def __init__(self, app: Any, *, routes: list[Any], prefix: str) -> None:
        self.app = app
        self.prefix = prefix
        self._routes: dict[str, list[tuple[Any, Handler]]] = {}
        for route in routes:
            if not isinstance(route, ThinRoute) or not route.path.startswith(prefix):
                continue
            handler = route.get_route_handler()
            if getattr(handler, "__qualname__", "").split(".")[0] != "ThinRoute":
                continue  # FastAPI's own handler: it needs the full stack
            for method in route.methods or ():
                self._routes.setdefault(method, []).append((route, handler))
        self.served = 0
        """Requests this path answered (tests read it)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix) or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        for route, handler in self._routes.get(scope["method"], ()):
            match = route.path_regex.match(path)
            if match is None:
                continue
            scope["route"] = route
            scope["endpoint"] = route.endpoint
            scope["path_params"] = {**scope.get("path_params", {}), **match.groupdict()}
            self.served += 1
            await self._serve(handler, scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _serve(self, handler: Handler, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sender(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        request = Request(scope, receive, sender)
        try:
            response = await handler(request)
            await response(scope, receive, sender)
        except Exception as exc:
            on_error = find_exception_handler(scope["app"], exc)
            if on_error is None:
                raise
            if started:
                raise RuntimeError("Caught handled exception, but response already started.") from exc
            answer = on_error(request, exc)
            if inspect.isawaitable(answer):
                answer = await answer
            await answer(scope, receive, sender)
            exc.__traceback__ = None


def find_exception_handler(app: Any, exc: Exception) -> Callable[[Request, Exception], Any] | None:
    handlers: dict[Any, Any] = app.exception_handlers
    if isinstance(exc, StarletteHTTPException) and exc.status_code in handlers:
        return handlers[exc.status_code]  # type: ignore[no-any-return]
    for klass in type(exc).__mro__:
        if klass in handlers:
            return handlers[klass]  # type: ignore[no-any-return]
    return None
