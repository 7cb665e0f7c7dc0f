"""What a writer says of a block that its key does not: ``X-KVGate-Block-Meta: parent=<hex>; tokens=1,2,3`` on a PUT
(contract/wire.py formats it), parsed at the edge and read when the PUT's change commits, for the KV events."""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass

from app.errors import InvalidRequest
from contract.wire import BLOCK_META_HEADER as META_HEADER
from contract.wire import MAX_BLOCK_META_BYTES as MAX_META_HEADER_BYTES
from contract.wire import MAX_BLOCK_META_TOKENS as MAX_META_TOKENS

__all__ = ["MAX_META_HEADER_BYTES", "MAX_META_TOKENS", "META_HEADER", "WriterMeta", "parse_meta_header", "writer_meta"]

_PARENT_RE = re.compile(r"(?:[0-9a-fA-F]{2}){8,32}")
"""A block hash: whole bytes of hex, 8 to 32 of them (an odd length is no hash, and no vLLM event could carry it)."""


@dataclass(frozen=True, slots=True)
class WriterMeta:
    """What the writer of a block knows that its key does not say: the block's token ids and its parent's hash."""

    token_ids: tuple[int, ...] = ()
    parent: str | None = None
    """The parent block's hash, hex, as in its key."""


writer_meta: ContextVar[WriterMeta | None] = ContextVar("kvgate_writer_meta", default=None)
"""Set by the PUT route for the request's task; read when its change commits."""


def parse_meta_header(value: str) -> WriterMeta:
    """``X-KVGate-Block-Meta: parent=<hex>; tokens=1,2,3`` (either part may be left out), at most 8 KiB."""
    if len(value) > MAX_META_HEADER_BYTES:
        raise InvalidRequest(f"{META_HEADER} is over {MAX_META_HEADER_BYTES} bytes")
    parent: str | None = None
    tokens: tuple[int, ...] = ()
    for part in value.split(";"):
        name, sep, text = part.strip().partition("=")
        if not sep:
            if name:
                raise InvalidRequest(f"{META_HEADER}: expected name=value, got {name[:40]!r}")
            continue
        if name == "parent" and text:
            if not _PARENT_RE.fullmatch(text):
                raise InvalidRequest(f"{META_HEADER}: parent must be a block hash (16-64 hex characters, whole bytes)")
            parent = text.lower()
        elif name == "tokens" and text:
            items = text.split(",")
            if len(items) > MAX_META_TOKENS:
                raise InvalidRequest(f"{META_HEADER}: more than {MAX_META_TOKENS} token ids")
            if not all(i.isdigit() and len(i) < 12 for i in items):
                raise InvalidRequest(f"{META_HEADER}: token ids must be non-negative integers")
            tokens = tuple(int(i) for i in items)
        elif name not in ("parent", "tokens"):
            raise InvalidRequest(f"{META_HEADER}: unknown field {name[:40]!r}")
    return WriterMeta(token_ids=tokens, parent=parent)
