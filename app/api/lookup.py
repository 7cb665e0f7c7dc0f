"""POST /v1/lookup: ordered block paths -> longest present prefix, one round trip per scheduler step."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from app.api.deps import service, settings
from app.api.errors import documented
from app.config import Settings
from app.core.service import BlockService
from app.errors import PayloadTooLarge
from connector.wire import quote_etag


class LookupRequest(BaseModel):
    keys: list[str] = Field(description="block paths in prefix order")


class LookupSlot(BaseModel):
    key: str
    present: bool
    size: int | None = None
    etag: str | None = None


class LookupResponse(BaseModel):
    prefix: int = Field(description="number of leading keys that are all present")
    blocks: list[LookupSlot] = Field(description="one slot per requested key, in order")


router = APIRouter(prefix="/v1", tags=["lookup"])


@router.post("/lookup", response_model=LookupResponse, responses=documented(400, 413, 503))
async def lookup(
    req: LookupRequest,
    svc: Annotated[BlockService, Depends(service)],
    cfg: Annotated[Settings, Depends(settings)],
) -> LookupResponse:
    if len(req.keys) > cfg.max_lookup_keys:
        raise PayloadTooLarge(f"{len(req.keys)} keys: at most {cfg.max_lookup_keys} per lookup")
    prefix, records = await svc.lookup(req.keys)
    return LookupResponse(
        prefix=prefix,
        blocks=[
            LookupSlot(
                key=k, present=r is not None, size=r.size if r else None, etag=quote_etag(r.digest) if r else None
            )
            for k, r in zip(req.keys, records, strict=True)
        ],
    )
