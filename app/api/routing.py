"""The app's routes as the router matches them: a request's path as the router sees it (:func:`route_path`), every
route flattened with its compiled path (:func:`route_table`), and the methods a resource has (:func:`allowed_methods`:
a 405's ``Allow``). Read by the auth middleware (which route a request is) and the error table (a 405)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from starlette.convertors import Convertor
from starlette.routing import compile_path
from starlette.types import Scope

_CONVERTER = re.compile(r"\{(\w+):\w+\}")


def template_of(path: str) -> str:
    """A route's path with converters dropped: ``/v1/blocks/{path:path}`` -> ``/v1/blocks/{path}``."""
    return _CONVERTER.sub(r"{\1}", path)


def route_path(scope: Scope) -> str:
    """The path the router matches: ``scope["path"]`` less ``scope["root_path"]`` where it starts with it (ASGI puts
    a mount point or proxy prefix in both), as Starlette's router strips it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    rest = path[len(root) :]
    return rest if rest.startswith("/") else path if rest else ""


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


def allowed_methods(routes: list[RouteShape], path: str) -> list[str]:
    """Every method some route serves at ``path`` (a path the router matches), sorted: the ``Allow`` of a 405. One
    resource is often several routes (a route per method), and Starlette's 405 names only the first one's."""
    return sorted({method for route in routes if route.regex.match(path) for method in route.methods})
