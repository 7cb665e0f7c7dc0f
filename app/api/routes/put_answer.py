"""The PUT of a block, read and answered in one place: the route (``put_block``, app/api/routes/blocks.py) and the
PUT lane (app/api/server/put_lane.py) call the same code.

:data:`PUT_HEADERS` names every request header a PUT reads; :func:`read_put` checks them (the key, Content-Length
and the size limit, If-None-Match, the checksum and block-meta headers, a part's Content-Range and part checksum)
and raises the app's errors; :func:`put_answer` is a whole block's answer (status, ETag, Location, the JSON body),
as bytes. The lane reads the headers :data:`PUT_HEADERS` names and sends a PUT with any of :data:`PART_HEADERS` to
the stack; tests/api/test_put_lane.py fails when the route reads a header that is not in :data:`PUT_HEADERS`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.core.service import PutResult
from app.errors import InvalidRequest, LengthRequired, PayloadTooLarge
from contract import wire
from contract.keys import BlockKey, parse_block_key
from contract.wire import (
    BLOCK_META_HEADER,
    CHECKSUM_HEADER,
    DIGEST_HEADER,
    PART_CHECKSUM_HEADER,
    PART_DIGEST_HEADER,
)

PUT_HEADERS: dict[str, str] = {
    "content-length": "content_length",
    "if-none-match": "if_none_match",
    CHECKSUM_HEADER.lower(): "checksum",
    DIGEST_HEADER.lower(): "sha256",
    BLOCK_META_HEADER.lower(): "block_meta",
    "content-range": "content_range",
    PART_CHECKSUM_HEADER.lower(): "part_checksum",
    PART_DIGEST_HEADER.lower(): "part_sha256",
}
"""Every request header the PUT route reads (its name in lower case) and the parameter of :func:`read_put` that
takes it."""
PART_HEADERS = frozenset({"content-range", PART_CHECKSUM_HEADER.lower(), PART_DIGEST_HEADER.lower()})
"""The headers of a part's PUT (the PUT lane leaves such a PUT to the stack)."""


@dataclass(slots=True)
class PutRequest:
    """A PUT whose headers passed :func:`read_put`."""

    key: BlockKey
    size: int
    create_only: bool
    meta: wire.BlockMetaValue | None
    digest: str | None
    """The checksum token the caller sent: the whole block's, or a part's."""
    span: wire.ByteSpan | None = None
    """A part's byte range (Content-Range); None: the whole block."""


def read_put(
    path: str,
    *,
    max_block_bytes: int,
    content_length: int | None = None,
    if_none_match: str | None = None,
    checksum: str | None = None,
    sha256: str | None = None,
    block_meta: str | None = None,
    content_range: str | None = None,
    part_checksum: str | None = None,
    part_sha256: str | None = None,
) -> PutRequest:
    """The PUT of ``path`` with these header values (None: absent), or the app's error for them, checked in this
    order: the key, the block meta, Content-Length (required, at most ``max_block_bytes``), If-None-Match (only
    ``*``), then a whole block's checksum, or a part's Content-Range, its object's size, its checksum and its
    length. A whole block's PUT never reads the part headers, a part's never the whole block's checksum."""
    key = parse_block_key(path)
    meta = wire.parse_block_meta(block_meta) if block_meta is not None else None
    if content_length is None:
        raise LengthRequired("Content-Length is required")
    if content_length > max_block_bytes:
        raise PayloadTooLarge(f"body of {content_length} bytes is over the {max_block_bytes}-byte limit")
    if if_none_match is not None and if_none_match.strip() != "*":
        raise InvalidRequest("only 'If-None-Match: *' is supported")
    create_only = if_none_match is not None
    if content_range is None:
        digest = wire.parse_request_checksum(checksum, sha256)
        return PutRequest(key, content_length, create_only, meta, None if digest is None else digest.token)
    span = wire.parse_content_range(content_range)  # MalformedHeader, RangeNotSatisfiable: the error table
    if span.total > max_block_bytes:
        raise PayloadTooLarge(f"object is over the {max_block_bytes}-byte limit")
    part_digest = wire.parse_request_checksum(
        part_checksum, part_sha256, header=PART_CHECKSUM_HEADER, legacy_header=PART_DIGEST_HEADER
    )
    if span.size != content_length:
        raise InvalidRequest(f"Content-Range covers {span.size} bytes, Content-Length says {content_length}")
    return PutRequest(key, content_length, create_only, meta, None if part_digest is None else part_digest.token, span)


@dataclass(slots=True)
class PutAnswer:
    """A whole block's PUT answered: what the route sends and the lane writes."""

    status: int
    headers: list[tuple[bytes, bytes]]
    """The header lines, as Starlette's Response has them (``raw_headers``)."""
    body: bytes


_JSON = (b"content-type", b"application/json")


def put_answer(result: PutResult) -> PutAnswer:
    """201 (stored) or 200 (the same bytes were there), the ETag, the Location and ``PutResponse``'s JSON, the bytes
    Starlette's ``Response(PutResponse(...).model_dump_json(), media_type="application/json", headers=...)`` has
    (tests/unit/test_put_answer.py), without building either."""
    meta = result.meta
    body = (
        f'{{"key":{_json(meta.key)},"size":{meta.size},"digest":{_json(meta.digest)},'
        f'"created":{"true" if result.created else "false"}}}'
    ).encode()
    headers = [
        (b"etag", wire.quote_etag(meta.digest).encode("latin-1")),
        (b"location", f"/v1/blocks/{meta.key}".encode("latin-1")),
        (b"content-length", str(len(body)).encode("latin-1")),
        _JSON,
    ]
    return PutAnswer(201 if result.created else 200, headers, body)


def _json(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
