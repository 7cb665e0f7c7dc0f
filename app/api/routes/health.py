"""Liveness and readiness."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from app.api.errors import documented, response_for
from app.api.routes.deps import service
from app.core.service import BlockService
from app.errors import KVGateError

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Store and index both answer", responses=documented(503))
async def readyz(svc: Annotated[BlockService, Depends(service)]) -> JSONResponse:
    try:
        await svc.check()
    except KVGateError as exc:
        return response_for(exc)
    return JSONResponse({"status": "ready"})
