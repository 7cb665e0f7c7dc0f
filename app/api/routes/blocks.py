"""PUT/GET/HEAD/DELETE /v1/blocks/{path}: thin handlers, headers <-> service calls, no storage code."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request, Response
from pydantic import BaseModel, Field
from starlette.types import Receive, Scope, Send

from app.api.errors import documented
from app.api.routes.deps import service, settings
from app.api.routes.put_answer import PutAnswer, PutRequest, put_answer, read_put
from app.api.routes.thin import ThinRoute
from app.config import Settings
from app.core.reads import OpenBlock, vouch_range
from app.core.service import BlockService
from app.core.values import Version
from contract import wire
from contract.keys import parse_block_key
from contract.wire import (
    BLOCK_META_HEADER,
    CHECKSUM_HEADER,
    DIGEST_HEADER,
    PART_CHECKSUM_HEADER,
    PART_DIGEST_HEADER,
    RANGE_CHECKSUM_HEADER,
    RANGE_DIGEST_HEADER,
    SHA256,
)

router = APIRouter(prefix="/v1/blocks", tags=["blocks"], route_class=ThinRoute)  # the data path: cheap binding

PATH_DOC = "A vLLM FileMapper path: `<ns>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin`"


class PutResponse(BaseModel):
    key: str
    size: int
    digest: str = Field(description="the checksum token the ETag quotes: `crc64nvme:<hex>`, or a sha256's bare hex")
    created: bool


class PartResponse(BaseModel):
    key: str
    start: int
    end: int = Field(description="inclusive, as in Content-Range")
    total: int
    part_digest: str = Field(description="the part's checksum token")
    complete: bool = Field(description="the parts now cover the object: it is visible")
    digest: str | None = Field(default=None, description="the whole object's checksum token once complete")


@functools.lru_cache(maxsize=4096)
def _checksum_headers(token: str) -> tuple[tuple[str, str], ...]:
    """The headers a version's checksum token gives (parsed once per token: HEAD and GET are the hot path)."""
    checksum = wire.parse_checksum_token(token)
    headers = [("ETag", checksum.etag), (CHECKSUM_HEADER, checksum.header)]
    if checksum.algorithm == SHA256:
        headers.append((DIGEST_HEADER, checksum.hex))
    return tuple(headers)


@functools.lru_cache(maxsize=4096)
def encoded_meta_headers(token: str, size: int) -> bytes:
    """:func:`meta_headers` of a version with checksum ``token`` and ``size`` bytes, with its Content-Length, as the
    lines of an HTTP/1.1 head (the HEAD and GET lanes write them as they are: app/api/server/lanes.py, get_lane.py;
    one cached call per answer)."""
    lines = [*_checksum_headers(token), ("Accept-Ranges", "bytes"), ("Content-Length", str(size))]
    return b"".join(f"{name.lower()}: {value}\r\n".encode("latin-1") for name, value in lines)


def meta_headers(meta: Version) -> dict[str, str]:
    """ETag (the quoted checksum token), X-KVGate-Checksum (``<algorithm>=<base64>``), and for a version stored
    with a sha256 its hex in X-KVGate-SHA256 too, as earlier clients read it."""
    return {**dict(_checksum_headers(meta.digest)), "Accept-Ranges": "bytes"}


class BlockResponse(Response):
    """Streams a block (or a range of it) with a Content-Length; the reader is closed whatever happens."""

    def __init__(self, block: OpenBlock, *, start: int, end: int, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(status_code=status_code, headers={**headers, "content-length": str(end - start)})
        self.media_type = "application/octet-stream"
        self.raw_headers.append((b"content-type", b"application/octet-stream"))
        self._chunks: AsyncIterator[bytes | bytearray] = block.stream(start, end)
        self._block = block

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._block.reader.aclose()


class EncodedResponse(Response):
    """A response whose status, header lines and body are already made (:func:`put_answer`'s)."""

    def __init__(self, answer: PutAnswer) -> None:
        self.status_code = answer.status
        self.raw_headers = answer.headers
        self.body = answer.body
        self.background = None


async def _put_part(request: Request, svc: BlockService, put: PutRequest, span: wire.ByteSpan) -> Response:
    """One rank's byte range of a multi-part object: 202 stored, 201 it completed the object, 200 nothing new."""
    out = await svc.put_part(
        put.key,
        request.stream(),
        span=span,
        part_digest=put.digest,
        create_only=put.create_only,
        meta=put.meta,
    )
    body = PartResponse(
        key=out.key,
        start=span.start,
        end=span.end - 1,
        total=span.total,
        part_digest=out.part_digest,
        complete=out.complete,
        digest=out.digest,
    )
    status = 200 if not out.created else 201 if out.complete else 202
    headers = {"Location": f"/v1/blocks/{out.key}"}
    if out.digest is not None:
        headers["ETag"] = wire.quote_etag(out.digest)
    return Response(body.model_dump_json(), status_code=status, media_type="application/json", headers=headers)


_PUT_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"description": "identical block (or part) already present", "model": PutResponse},
    202: {"description": "part stored; the object is not complete yet", "model": PartResponse},
}


@router.put(
    "/{path:path}",
    summary="Store a block",
    status_code=201,
    response_model=PutResponse,
    responses=_PUT_RESPONSES | documented(400, 409, 411, 412, 413, 416, 503, 507),
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
    x_kvgate_checksum: Annotated[
        str | None,
        Header(alias=CHECKSUM_HEADER, description="`crc64nvme=<base64>` or `sha256=<base64>` of the body: verified"),
    ] = None,
    x_kvgate_sha256: Annotated[
        str | None, Header(alias=DIGEST_HEADER, description="hex sha256 of the body (earlier clients)")
    ] = None,
    content_range: Annotated[
        str | None, Header(description="`bytes a-b/total`: store one part of a multi-part object")
    ] = None,
    x_kvgate_part_checksum: Annotated[
        str | None, Header(alias=PART_CHECKSUM_HEADER, description="`<algorithm>=<base64>` of this part's bytes")
    ] = None,
    x_kvgate_part_sha256: Annotated[
        str | None, Header(alias=PART_DIGEST_HEADER, description="hex sha256 of this part's bytes (earlier clients)")
    ] = None,
    x_kvgate_block_meta: Annotated[
        str | None, Header(alias=BLOCK_META_HEADER, description="`parent=<hex>; tokens=1,2,3`: for the KV events")
    ] = None,
) -> Response:
    put = read_put(
        path,
        max_block_bytes=cfg.max_block_bytes,
        content_length=content_length,
        if_none_match=if_none_match,
        checksum=x_kvgate_checksum,
        sha256=x_kvgate_sha256,
        block_meta=x_kvgate_block_meta,
        content_range=content_range,
        part_checksum=x_kvgate_part_checksum,
        part_sha256=x_kvgate_part_sha256,
    )
    if put.span is not None:
        return await _put_part(request, svc, put, put.span)
    result = await svc.put(
        put.key, request.stream(), size=put.size, digest=put.digest, create_only=put.create_only, meta=put.meta
    )
    return EncodedResponse(put_answer(result))


@router.get(
    "/{path:path}",
    summary="Read a block (Range supported)",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        206: {"description": "the requested range", "content": {"application/octet-stream": {}}},
        **documented(400, 404, 416, 503),
    },
)
async def get_block(
    path: str,
    svc: Annotated[BlockService, Depends(service)],
    range_: Annotated[str | None, Header(alias="Range")] = None,
) -> Response:
    key = parse_block_key(path)
    block = await svc.open(key)
    try:
        span = None if range_ is None else wire.parse_range(range_, size=block.meta.size)
    except BaseException:
        await block.reader.aclose()
        raise
    headers = meta_headers(block.meta)
    if span is None:
        return BlockResponse(block, start=0, end=block.meta.size, status_code=200, headers=headers)
    start, end = span
    headers["Content-Range"] = wire.format_content_range(start=start, end=end, total=block.meta.size)
    try:  # every range, at every size: its checksum, from the chunk CRCs recorded at write time (app/core/reads.py)
        proof = await vouch_range(block, start, end)
    except BaseException:
        await block.reader.aclose()
        raise
    headers[RANGE_CHECKSUM_HEADER] = proof.crc.header
    if proof.sha256 is not None:
        headers[RANGE_DIGEST_HEADER] = proof.sha256
    return BlockResponse(block, start=start, end=end, status_code=206, headers=headers)


@router.head(
    "/{path:path}",
    summary="Size and ETag of a block",
    response_class=Response,
    responses={200: {"description": "present; Content-Length is its size"}, **documented(400, 404, 503)},
)
async def head_block(path: str, svc: Annotated[BlockService, Depends(service)]) -> Response:
    meta = await svc.head(parse_block_key(path))
    return Response(status_code=200, headers={**meta_headers(meta), "content-length": str(meta.size)})


@router.delete(
    "/{path:path}",
    summary="Remove a block",
    status_code=204,
    response_class=Response,
    responses=documented(400, 404, 503),
)
async def delete_block(path: str, svc: Annotated[BlockService, Depends(service)]) -> Response:
    await svc.delete(parse_block_key(path))
    return Response(status_code=204)
