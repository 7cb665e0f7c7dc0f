"""Admin plane: what is stored per namespace, gateway stats, and purging a namespace."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from app.api.errors import documented
from app.api.routes.deps import capacity, service, upkeep
from app.core.capacity import Capacity
from app.core.service import BlockService
from app.core.upkeep import Upkeep
from app.core.values import NamespaceUsage
from app.errors import NamespaceNotFound
from contract.keys import parse_namespace

router = APIRouter(prefix="/v1", tags=["admin"])


class NamespaceSummary(BaseModel):
    namespace: str
    blocks: int
    bytes: int
    hits: int = Field(description="reads (GET) of its blocks, as flushed to the index")
    last_write: float | None = Field(description="unix time of the newest block write")
    last_access: float | None = Field(description="unix time of the newest read or write")
    never_read_ratio: float = Field(
        description="share of its blocks written and never read: near 1.0 means the engine's hashes are not "
        "deterministic (nothing it writes is ever found again)"
    )
    has_config: bool = Field(description="its run fields are recorded (PUT /v1/namespaces/{ns}/config)")


class NamespaceList(BaseModel):
    namespaces: list[NamespaceSummary]


class PurgeResult(BaseModel):
    namespace: str
    blocks: int = Field(description="blocks removed")
    bytes: int = Field(description="bytes removed")
    config: bool = Field(description="its config was removed too")


class Stats(BaseModel):
    usage_bytes: int
    max_bytes: int | None
    usage_ratio: float | None = Field(description="usage_bytes / max_bytes")
    high_watermark: float
    low_watermark: float
    namespace_quota_bytes: int | None
    blocks: int
    namespaces: int
    hits: int = Field(description="GET/HEAD that found the block")
    misses: int = Field(description="GET/HEAD that did not")
    evictions: int
    evicted_bytes: int
    evicting: bool = Field(
        description="an eviction round of a process of this machine is in flight (this one's or another worker's): "
        "usage is still falling toward the low watermark"
    )
    uptime_s: float


def _summary(u: NamespaceUsage, *, has_config: bool) -> NamespaceSummary:
    return NamespaceSummary(
        namespace=u.namespace,
        blocks=u.blocks,
        bytes=u.bytes,
        hits=u.hits,
        last_write=u.last_write,
        last_access=u.last_access,
        never_read_ratio=(u.never_read / u.blocks) if u.blocks else 0.0,
        has_config=has_config,
    )


def _empty(name: str) -> NamespaceUsage:
    return NamespaceUsage(namespace=name, blocks=0, bytes=0, hits=0, never_read=0, last_write=None, last_access=None)


@router.get(
    "/namespaces",
    response_model=NamespaceList,
    summary="Every namespace: blocks, bytes, hits",
    responses=documented(503),
)
async def list_namespaces(up: Annotated[Upkeep, Depends(upkeep)]) -> NamespaceList:
    views = await up.views()
    usage = {u.namespace: u for u in views.usage}
    configured = views.configured
    names = sorted(set(usage) | configured)
    return NamespaceList(namespaces=[_summary(usage.get(n) or _empty(n), has_config=n in configured) for n in names])


@router.get(
    "/namespaces/{namespace}",
    response_model=NamespaceSummary,
    summary="One namespace: blocks, bytes, hits",
    responses=documented(400, 404, 503),
)
async def get_namespace(namespace: str, up: Annotated[Upkeep, Depends(upkeep)]) -> NamespaceSummary:
    parse_namespace(namespace)  # InvalidKey: a 400 from the error table
    views = await up.views(namespace)
    rows, has_config = views.usage, namespace in views.configured
    if not rows and not has_config:
        raise NamespaceNotFound(namespace)
    return _summary(rows[0] if rows else _empty(namespace), has_config=has_config)


@router.delete(
    "/namespaces/{namespace}",
    response_model=PurgeResult,
    summary="Purge a namespace: block data, rows and config",
    responses=documented(400, 404, 503),
)
async def purge_namespace(
    namespace: str, up: Annotated[Upkeep, Depends(upkeep)], svc: Annotated[BlockService, Depends(service)]
) -> PurgeResult:
    report = await up.purge(namespace)
    svc.forget_layout(namespace)
    return PurgeResult(namespace=namespace, blocks=report.blocks, bytes=report.bytes, config=report.config)


@router.get(
    "/stats", response_model=Stats, summary="Usage, capacity, hits, misses, evictions", responses=documented(503)
)
async def stats(
    request: Request,
    svc: Annotated[BlockService, Depends(service)],
    cap: Annotated[Capacity, Depends(capacity)],
) -> Stats:
    usage = await cap.refresh()  # exact across processes, as of the last commit of any
    return Stats(
        usage_bytes=usage.bytes,
        max_bytes=cap.max_bytes,
        usage_ratio=(usage.bytes / cap.max_bytes) if cap.max_bytes else None,
        high_watermark=cap.high,
        low_watermark=cap.low,
        namespace_quota_bytes=cap.quota,
        blocks=usage.blocks,
        namespaces=len(usage.by_namespace),
        hits=svc.counters.hits,
        misses=svc.counters.misses,
        evictions=cap.evictions,
        evicted_bytes=cap.evicted_bytes,
        evicting=cap.evicting,
        uptime_s=time.monotonic() - request.app.state.started_at,
    )
