"""Swagger UI and ReDoc served by the gateway itself: no CDN, so /docs works on an air-gapped cluster.

The JavaScript and CSS come from the ``fastapi-offline`` package (it ships Swagger UI 5 and ReDoc 2, the versions
FastAPI's own pages load from a CDN); the pages are FastAPI's, pointed at ``/docs/assets/<file>``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse

ASSET_PREFIX = "/docs/assets"
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
    "favicon.png": "image/png",
}
_CACHE = {"Cache-Control": "public, max-age=86400"}


def asset_dir() -> Path:
    """fastapi-offline keeps its files in its package's ``static/`` folder (a layout its releases keep)."""
    return Path(str(resources.files("fastapi_offline") / "static"))


def install(app: FastAPI) -> None:
    """/docs, /docs/oauth2-redirect, /redoc and their assets (create the app with ``docs_url=None, redoc_url=None``)."""
    router = APIRouter(include_in_schema=False)
    folder = asset_dir()
    openapi_url = app.openapi_url or "/openapi.json"
    redirect_url = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    @router.get("/docs")
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{redirect_url}",
            swagger_js_url=f"{root}{ASSET_PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSET_PREFIX}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSET_PREFIX}/favicon.png",
            swagger_ui_parameters={"persistAuthorization": False, "tryItOutEnabled": False},
        )

    @router.get(redirect_url)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @router.get("/redoc")
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSET_PREFIX}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSET_PREFIX}/favicon.png",
            with_google_fonts=False,
        )

    @router.get(ASSET_PREFIX + "/{asset}")
    async def docs_asset(asset: str) -> FileResponse:
        media_type = ASSETS.get(asset)
        if media_type is None:
            raise HTTPException(status_code=404, detail=f"no docs asset {asset!r}")
        return FileResponse(folder / asset, media_type=media_type, headers=_CACHE)

    app.include_router(router)
