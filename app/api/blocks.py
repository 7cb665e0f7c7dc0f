"""PUT/GET/HEAD/DELETE /v1/blocks/{path}: thin handlers, headers <-> service calls, no storage code."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request, Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from app.api.deps import service, settings
from app.api.errors import documented
from app.config import Settings
from app.errors import InvalidRequest, LengthRequired, PayloadTooLarge
from app.service import BlockMeta, BlockService, OpenBlock, parse_key, resolve_range
from connector.protocol import DIGEST_HEADER

router = APIRouter(prefix="/v1/blocks", tags=["blocks"])

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
PATH_DOC = "A vLLM FileMapper path: `<ns>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin`"


class PutResponse(BaseModel):
    key: str
    size: int
    digest: str
    created: bool


def etag(meta: BlockMeta) -> str:
    return f'"{meta.digest}"'


def meta_headers(meta: BlockMeta) -> dict[str, str]:
    return {"ETag": etag(meta), DIGEST_HEADER: meta.digest, "Accept-Ranges": "bytes"}


class BlockResponse(Response):
    """Streams a block (or a range of it) with a Content-Length; the reader is closed whatever happens."""

    def __init__(self, block: OpenBlock, *, start: int, end: int, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(status_code=status_code, headers={**headers, "content-length": str(end - start)})
        self.media_type = "application/octet-stream"
        self.raw_headers.append((b"content-type", b"application/octet-stream"))
        self._chunks: AsyncIterator[bytes] = block.stream(start, end)
        self._block = block

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._block.reader.aclose()


def _digest_header(value: str | None) -> str | None:
    if value is None:
        return None
    if not _HEX64.fullmatch(value):
        raise InvalidRequest(f"{DIGEST_HEADER} must be 64 hex characters (sha256)")
    return value.lower()


@router.put(
    "/{path:path}",
    summary="Store a block",
    status_code=201,
    response_model=PutResponse,
    responses={200: {"description": "identical block already present", "model": PutResponse}}
    | documented(400, 411, 412, 413, 503, 507),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def put_block(
    path: str,
    request: Request,
    svc: Annotated[BlockService, Depends(service)],
    cfg: Annotated[Settings, Depends(settings)],
    content_length: Annotated[int | None, Header(ge=0)] = None,
    if_none_match: Annotated[str | None, Header()] = None,
    x_kvgate_sha256: Annotated[str | None, Header(alias=DIGEST_HEADER, description="hex sha256 of the body")] = None,
) -> Response:
    key = parse_key(path)
    if content_length is None:
        raise LengthRequired("Content-Length is required")
    if content_length > cfg.max_block_bytes:
        raise PayloadTooLarge(f"body of {content_length} bytes is over the {cfg.max_block_bytes}-byte limit")
    if if_none_match is not None and if_none_match.strip() != "*":
        raise InvalidRequest("only 'If-None-Match: *' is supported")
    result = await svc.put(
        key,
        request.stream(),
        size=content_length,
        digest=_digest_header(x_kvgate_sha256),
        create_only=if_none_match is not None,
    )
    body = PutResponse(key=result.meta.key, size=result.meta.size, digest=result.meta.digest, created=result.created)
    return Response(
        body.model_dump_json(),
        status_code=201 if result.created else 200,
        media_type="application/json",
        headers={"ETag": etag(result.meta), "Location": f"/v1/blocks/{result.meta.key}"},
    )


@router.get(
    "/{path:path}",
    summary="Read a block (Range supported)",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        206: {"description": "the requested range", "content": {"application/octet-stream": {}}},
    }
    | documented(400, 404, 416, 503),
)
async def get_block(
    path: str,
    svc: Annotated[BlockService, Depends(service)],
    range_: Annotated[str | None, Header(alias="Range")] = None,
) -> Response:
    key = parse_key(path)
    block = await svc.open(key)
    try:
        span = resolve_range(range_, block.meta.size)
    except BaseException:
        await block.reader.aclose()
        raise
    headers = meta_headers(block.meta)
    if span is None:
        return BlockResponse(block, start=0, end=block.meta.size, status_code=200, headers=headers)
    start, end = span
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{block.meta.size}"
    return BlockResponse(block, start=start, end=end, status_code=206, headers=headers)


@router.head(
    "/{path:path}",
    summary="Size and ETag of a block",
    response_class=Response,
    responses={200: {"description": "present; Content-Length is its size"}} | documented(400, 404, 503),
)
async def head_block(path: str, svc: Annotated[BlockService, Depends(service)]) -> Response:
    meta = await svc.head(parse_key(path))
    return Response(status_code=200, headers={**meta_headers(meta), "content-length": str(meta.size)})


@router.delete(
    "/{path:path}",
    summary="Remove a block",
    status_code=204,
    response_class=Response,
    responses=documented(400, 404, 503),
)
async def delete_block(path: str, svc: Annotated[BlockService, Depends(service)]) -> Response:
    await svc.delete(parse_key(path))
    return Response(status_code=204)
