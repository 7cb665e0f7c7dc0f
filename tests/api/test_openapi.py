"""The spec describes every route with its status codes, and Swagger UI serves."""

from __future__ import annotations

import httpx
from starlette.routing import Route

from app.config import Settings
from app.main import create_app
from tests.gateway import Gateway


def test_spec_covers_every_route(tmp_path: object) -> None:
    app = create_app(Settings())
    spec = app.openapi()
    documented = {(path, method.upper()) for path, ops in spec["paths"].items() for method in ops}
    for route in app.routes:
        if not isinstance(route, Route) or not route.include_in_schema:
            continue
        path = route.path.replace(":path}", "}")
        for method in route.methods or ():
            if method == "HEAD" and "GET" in (route.methods or ()):
                continue
            assert (path, method) in documented, (path, method)

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
