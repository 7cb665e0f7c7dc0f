"""What a writer says of a block that its key does not: ``X-KVGate-Block-Meta: parent=<hex>; tokens=1,2,3`` on a PUT
(contract/wire.py formats it), parsed at the edge and read when the PUT's change commits, for the KV events."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from contract.wire import BLOCK_META_HEADER as META_HEADER
from contract.wire import MAX_BLOCK_META_BYTES as MAX_META_HEADER_BYTES
from contract.wire import MAX_BLOCK_META_TOKENS as MAX_META_TOKENS
from contract.wire import parse_block_meta

__all__ = ["MAX_META_HEADER_BYTES", "MAX_META_TOKENS", "META_HEADER", "WriterMeta", "parse_meta_header", "writer_meta"]


@dataclass(frozen=True, slots=True)
class WriterMeta:
    """What the writer of a block knows that its key does not say: the block's token ids and its parent's hash."""

    token_ids: tuple[int, ...] = ()
    parent: str | None = None
    """The parent block's hash, hex, as in its key."""


writer_meta: ContextVar[WriterMeta | None] = ContextVar("kvgate_writer_meta", default=None)
"""Set by the PUT route for the request's task; read when its change commits."""


def parse_meta_header(value: str) -> WriterMeta:
    """``X-KVGate-Block-Meta: parent=<hex>; tokens=1,2,3`` (either part may be left out), as
    :func:`contract.wire.parse_block_meta` reads it: ASCII digits and hex only, at most 8 KiB and 1,024 token ids,
    a parent of whole bytes; anything else is a ``MalformedHeader`` (a 400 from the error table)."""
    meta = parse_block_meta(value)
    return WriterMeta(token_ids=meta.tokens, parent=meta.parent)
