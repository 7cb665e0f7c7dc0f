"""PUT/GET /v1/namespaces/{ns}/config: the run's fields, checked against the namespace's digest."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Response

from app.api.errors import documented
from app.api.routes.deps import service
from app.core.service import BlockService

router = APIRouter(prefix="/v1/namespaces", tags=["namespaces"])


@router.put(
    "/{namespace}/config",
    summary="Record a run's fields (their digest must match the namespace's name)",
    status_code=201,
    responses={200: {"description": "already recorded with the same fields"}, **documented(400, 409, 503, 507)},
)
async def put_config(
    namespace: str,
    fields: Annotated[dict[str, Any], Body(description="FileMapper fields of the run")],
    svc: Annotated[BlockService, Depends(service)],
) -> Response:
    raw = json.dumps(fields, sort_keys=True, indent=2).encode()
    created = await svc.put_config(namespace, fields, raw)
    return Response(
        json.dumps({"namespace": namespace, "created": created}),
        status_code=201 if created else 200,
        media_type="application/json",
    )


@router.get("/{namespace}/config", summary="A run's fields", responses=documented(400, 404, 503))
async def get_config(namespace: str, svc: Annotated[BlockService, Depends(service)]) -> dict[str, Any]:
    return await svc.get_config(namespace)
