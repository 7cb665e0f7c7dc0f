"""POST /v1/lookup: ordered block paths -> longest present prefix, one round trip per scheduler step.

With ``wait_ms`` the answer waits, bounded, until at least ``min_prefix`` keys are present: a prefill/decode
consumer waits there for the blocks its producer is still storing (app/core/arrivals.py), instead of polling.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import BaseModel, Field, field_validator

from app.api.errors import documented
from app.api.routes.deps import service, settings
from app.config import Settings
from app.core.service import BlockService
from app.errors import PayloadTooLarge

MAX_LOOKUP_WAIT_MS = 5_000
"""The longest a lookup waits for its prefix; a longer ``wait_ms`` is cut to this."""


class LookupRequest(BaseModel):
    keys: list[str] = Field(description="block paths in prefix order")
    wait_ms: int = Field(
        default=0,
        ge=0,
        description=(
            "wait up to this long for at least min_prefix keys to be present, then answer what is present "
            f"(0: answer at once; more than {MAX_LOOKUP_WAIT_MS} is cut to {MAX_LOOKUP_WAIT_MS}). A block stored "
            "through this gateway process wakes the wait at once; one stored through another process is seen "
            "within 50 ms"
        ),
    )
    min_prefix: int | None = Field(
        default=None,
        ge=0,
        strict=True,
        description="the prefix to wait for, in keys (absent: all of them; only with wait_ms)",
    )

    @field_validator("wait_ms", "min_prefix", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: object) -> object:
        """Integers as JSON Schema reads them (199.0 is one), never a boolean read as one."""
        if isinstance(value, bool):
            raise ValueError("an integer, not a boolean")
        return value


class LookupSlot(BaseModel):
    key: str
    present: bool
    size: int | None = None
    etag: str | None = None


class LookupResponse(BaseModel):
    prefix: int = Field(description="number of leading keys that are all present")
    blocks: list[LookupSlot] = Field(description="one slot per requested key, in order")


JSON = "application/json"
router = APIRouter(prefix="/v1", tags=["lookup"])


@router.post("/lookup", response_model=LookupResponse, responses=documented(400, 413, 503))
async def lookup(
    req: LookupRequest,
    svc: Annotated[BlockService, Depends(service)],
    cfg: Annotated[Settings, Depends(settings)],
) -> Response:
    if len(req.keys) > cfg.max_lookup_keys:
        raise PayloadTooLarge(f"{len(req.keys)} keys: at most {cfg.max_lookup_keys} per lookup")
    wait_s = min(req.wait_ms, MAX_LOOKUP_WAIT_MS) / 1000
    prefix, slots = await svc.lookup(req.keys, wait_s=wait_s, min_prefix=req.min_prefix)
    # LookupResponse's JSON written directly: a model per slot and FastAPI's re-validation of the response were
    # most of a 1,000-key lookup's time, and json.dumps half of what was left. Nothing here needs escaping: a key
    # that parsed is [A-Za-z0-9._/-] only, a digest hex (tests/inprocess/test_lookup.py holds the bytes to the model's
    # own dump).
    blocks = ",".join(
        f'{{"key":"{k}","present":true,"size":{s[0]},"etag":"\\"{s[1]}\\""}}'
        if s is not None
        else f'{{"key":"{k}","present":false,"size":null,"etag":null}}'
        for k, s in zip(req.keys, slots, strict=True)
    )
    return Response(f'{{"prefix":{prefix},"blocks":[{blocks}]}}', media_type=JSON)
