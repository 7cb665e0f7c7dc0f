"""The spec describes every route with its status codes, and Swagger UI serves."""

from __future__ import annotations

import httpx
from fastapi.routing import iter_route_contexts
from starlette.routing import Route

from app.config import Settings
from app.main import create_app
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
