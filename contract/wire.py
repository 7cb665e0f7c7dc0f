"""kvgate's wire format, owned here once for the gateway and the connector alike: the ``Range`` and
``Content-Range`` values, ETag quoting, the sha256 digest headers and the block meta a writer sends for the KV events.

Pure functions over strings, no HTTP library, standard library only: ``app`` and ``connector`` both import it.
Byte ranges are half-open ``[start, end)`` in Python and inclusive on the wire.
Malformed values raise ``MalformedHeader``; a well-formed range that selects nothing of the object raises
``RangeNotSatisfiable`` (with the object's size, for the 416's ``Content-Range: bytes */size``).
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BLOCK_META_HEADER",
    "DIGEST_HEADER",
    "PART_DIGEST_HEADER",
    "RANGE_DIGEST_HEADER",
    "ByteSpan",
    "MalformedHeader",
    "RangeNotSatisfiable",
    "WireError",
    "format_block_meta",
    "format_content_range",
    "format_range",
    "parse_content_range",
    "parse_digest",
    "parse_range",
    "quote_etag",
    "retry_after_s",
    "unquote_etag",
    "unsatisfied_content_range",
]

DIGEST_HEADER = "X-KVGate-SHA256"
"""Hex sha256 of the whole object; sent with a PUT to have it verified before anything is published."""
PART_DIGEST_HEADER = "X-KVGate-Part-SHA256"
"""Hex sha256 of one part's bytes (a PUT with ``Content-Range``)."""
RANGE_DIGEST_HEADER = "X-KVGate-Range-SHA256"
"""On a 206: hex sha256 of the range's bytes, sent after the gateway checked the whole object against its digest."""
BLOCK_META_HEADER = "X-KVGate-Block-Meta"
"""``parent=<hex>; tokens=1,2,3`` on a PUT: the block's token ids and its parent's hash, for the KV events."""
MAX_BLOCK_META_BYTES = 8192
MAX_BLOCK_META_TOKENS = 1024

_RANGE = re.compile(r"bytes=([0-9]{0,18})-([0-9]{0,18})", re.ASCII | re.IGNORECASE)
"""One ``bytes=a-b`` range, ASCII digits only (``str.isdigit`` also accepts '²' and other digits ``int`` rejects)."""
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,15})-([0-9]{1,15})/([0-9]{1,15})", re.ASCII)
_HEX64 = re.compile(r"[0-9a-fA-F]{64}", re.ASCII)


class WireError(ValueError):
    """A header value kvgate cannot use."""


class MalformedHeader(WireError):
    """Not the grammar kvgate speaks (a 400 at the gateway)."""


class RangeNotSatisfiable(WireError):
    """A well-formed range that selects nothing of a ``size``-byte object (a 416 at the gateway)."""

    def __init__(self, message: str, *, size: int) -> None:
        super().__init__(message)
        self.size = size


@dataclass(frozen=True, slots=True)
class ByteSpan:
    """A part's half-open range ``[start, end)`` of an object of ``total`` bytes."""

    start: int
    end: int
    total: int

    @property
    def size(self) -> int:
        return self.end - self.start


def _check_span(start: int, end: int) -> None:
    if not 0 <= start < end:
        raise ValueError(f"not a non-empty byte range: [{start}, {end})")


# -- Range (a GET's request header) --------------------------------------------------------------------------------


def format_range(*, start: int, end: int) -> str:
    """``Range`` request value for the half-open byte range ``[start, end)``."""
    _check_span(start, end)
    return f"bytes={start}-{end - 1}"


def parse_range(spec: str, *, size: int) -> tuple[int, int]:
    """A single ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range of a ``size``-byte object as ``[start, end)``.

    MalformedHeader if malformed or several ranges; RangeNotSatisfiable if it selects nothing of the object.
    """
    m = _RANGE.fullmatch(spec.strip())
    if m is None or not (m[1] or m[2]):
        raise MalformedHeader(f"malformed range {spec[:80]!r}: only a single 'bytes=a-b' range is supported")
    first, last = m[1], m[2]
    if not first:  # suffix range: the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"suffix range {spec!r} of a {size}-byte object", size=size)
        return max(0, size - n), size
    start = int(first)
    if last and int(last) < start:
        raise RangeNotSatisfiable(f"range {spec!r} ends before it starts", size=size)
    if start >= size:
        raise RangeNotSatisfiable(f"range {spec!r} outside 0-{size - 1}", size=size)
    return start, min(size, int(last) + 1) if last else size


# -- Content-Range (a part PUT's request header, a 206's and a 416's response header) -----------------------------


def format_content_range(*, start: int, end: int, total: int) -> str:
    """``Content-Range`` value for the half-open part ``[start, end)`` of a ``total``-byte object."""
    _check_span(start, end)
    if end > total:
        raise ValueError(f"range end {end} past object size {total}")
    return f"bytes {start}-{end - 1}/{total}"


def unsatisfied_content_range(size: int) -> str:
    """``Content-Range`` of a 416: the object's size and no range."""
    return f"bytes */{size}"


def parse_content_range(value: str) -> ByteSpan:
    """``bytes a-b/total`` (inclusive ``b``) -> ByteSpan; MalformedHeader, or RangeNotSatisfiable past ``total``."""
    m = _CONTENT_RANGE.fullmatch(value.strip())
    if m is None:
        raise MalformedHeader(f"Content-Range must be 'bytes a-b/total', got {value[:80]!r}")
    first, last, total = int(m[1]), int(m[2]), int(m[3])
    if last < first:
        raise MalformedHeader(f"Content-Range {value!r}: end before start")
    if last >= total:
        raise RangeNotSatisfiable(f"Content-Range {value!r} reaches past the object's {total} bytes", size=total)
    return ByteSpan(start=first, end=last + 1, total=total)


# -- ETag and the digest headers -----------------------------------------------------------------------------------


def quote_etag(digest: str) -> str:
    """The strong ETag of an object whose sha256 is ``digest``."""
    return f'"{digest}"'


def unquote_etag(value: str | None) -> str | None:
    """The digest a strong ETag carries (lower case); None for no ETag, a weak one, or an empty one."""
    if value is None:
        return None
    value = value.strip()
    if value.startswith("W/"):
        return None
    return value.strip('"').lower() or None


def parse_digest(value: str | None, *, header: str = DIGEST_HEADER) -> str | None:
    """A digest header's hex sha256, lower case; None when absent; MalformedHeader unless 64 hex characters."""
    if value is None:
        return None
    if not _HEX64.fullmatch(value):
        raise MalformedHeader(f"{header} must be 64 hex characters (sha256)")
    return value.lower()


# -- Retry-After (a 429's or 503's response header) --------------------------------------------------------------------


def retry_after_s(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP-date); None when absent or malformed."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # '²'.isdigit() too, and float() refuses it
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


# -- X-KVGate-Block-Meta (a PUT's request header: what the KV events say of the block) -------------------------------


def format_block_meta(*, parent: str | bytes | None, tokens: Sequence[int]) -> str | None:
    """The header's value for a block continuing ``parent`` (its hash) with ``tokens``; None when there is nothing
    to say or it is over the limits the gateway accepts (the block is then stored without it: its event carries no
    token ids)."""
    if len(tokens) > MAX_BLOCK_META_TOKENS:
        return None
    parts = []
    if parent is not None:
        parts.append(f"parent={parent.hex() if isinstance(parent, bytes) else parent}")
    if tokens:
        parts.append("tokens=" + ",".join(map(str, tokens)))
    value = "; ".join(parts)
    return value if value and len(value) <= MAX_BLOCK_META_BYTES else None
