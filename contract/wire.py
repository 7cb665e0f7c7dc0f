"""kvgate's wire format, owned here once for the gateway and the connector alike: the ``Range`` and
``Content-Range`` values, ETag quoting, the checksum headers (``X-KVGate-Checksum: crc64nvme=<base64>``, and the
sha256 ones of earlier clients), the writer's block meta, event ids, bearer tokens and the JSON bodies the gateway
reads. The grammar of checksums lives here; computing them does not (the standard library has no CRC64NVME).

Pure functions over strings, no HTTP library, standard library only: ``app`` and ``connector`` both import it.
Byte ranges are half-open ``[start, end)`` in Python and inclusive on the wire.
Every parser here takes ASCII grammar only (``str.isdigit`` and ``int`` also take '²' or Arabic-Indic digits: no
parser uses them) and bounded sizes, and fails with a :class:`WireError`: malformed values raise
``MalformedHeader`` (``MalformedBody`` for a body); a well-formed range that selects nothing of the object raises
``RangeNotSatisfiable`` (with the object's size, for the 416's ``Content-Range: bytes */size``). The gateway maps
each to its 4xx in one table, so no input reaches a 5xx through a parser.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ALGORITHMS",
    "BLOCK_META_HEADER",
    "CHECKSUM_HEADER",
    "CRC64NVME",
    "DEFAULT_ALGORITHM",
    "DIGEST_HEADER",
    "PART_CHECKSUM_HEADER",
    "PART_DIGEST_HEADER",
    "RANGE_CHECKSUM_HEADER",
    "RANGE_DIGEST_HEADER",
    "SHA256",
    "BlockMetaValue",
    "ByteSpan",
    "Checksum",
    "MalformedBody",
    "MalformedHeader",
    "RangeNotSatisfiable",
    "WireError",
    "etag_checksum",
    "format_block_meta",
    "format_content_range",
    "format_range",
    "parse_bearer",
    "parse_block_meta",
    "parse_checksum",
    "parse_checksum_token",
    "parse_content_range",
    "parse_digest",
    "parse_json",
    "parse_range",
    "parse_request_checksum",
    "parse_uint",
    "quote_etag",
    "retry_after_s",
    "unquote_etag",
    "unsatisfied_content_range",
]

CHECKSUM_HEADER = "X-KVGate-Checksum"
"""``<algorithm>=<base64>`` of the whole object: on a PUT, verified before anything is published; on a GET or HEAD,
the stored version's checksum (the algorithm its writer chose)."""
PART_CHECKSUM_HEADER = "X-KVGate-Part-Checksum"
"""``<algorithm>=<base64>`` of one part's bytes (a PUT with ``Content-Range``)."""
RANGE_CHECKSUM_HEADER = "X-KVGate-Range-Checksum"
"""On a 206: ``crc64nvme=<base64>`` of exactly the range's bytes, vouched for by the gateway from the checksums of
the object's chunks recorded when it was written (every size, every range)."""
DIGEST_HEADER = "X-KVGate-SHA256"
"""Hex sha256 of the whole object (earlier clients): on a PUT, as ``X-KVGate-Checksum: sha256=...``; answered on a
GET or HEAD of a version stored with a sha256."""
PART_DIGEST_HEADER = "X-KVGate-Part-SHA256"
"""Hex sha256 of one part's bytes (earlier clients; a PUT with ``Content-Range``)."""
RANGE_DIGEST_HEADER = "X-KVGate-Range-SHA256"
"""On a 206 of a version stored with a sha256: hex sha256 of the range's bytes (for earlier clients)."""

CRC64NVME = "crc64nvme"
"""CRC-64/NVME (S3's full-object ``x-amz-checksum-crc64nvme``): kvgate's default, at memory speed."""
SHA256 = "sha256"
"""A cryptographic digest, for those who want one (per request: ``X-KVGate-Checksum: sha256=...``)."""
ALGORITHMS = {CRC64NVME: 8, SHA256: 32}
"""Each algorithm kvgate speaks, and its value's size in bytes."""
DEFAULT_ALGORITHM = CRC64NVME
BLOCK_META_HEADER = "X-KVGate-Block-Meta"
"""``parent=<hex>; tokens=1,2,3`` on a PUT: the block's token ids and its parent's hash, for the KV events."""
MAX_BLOCK_META_BYTES = 8192
MAX_BLOCK_META_TOKENS = 1024
MAX_TOKEN_ID_DIGITS = 11
MAX_JSON_DEPTH = 32
"""Deepest nesting of a JSON body the gateway reads (a lookup is 2 deep, a namespace's fields 4)."""

_RANGE = re.compile(r"bytes=([0-9]{0,18})-([0-9]{0,18})", re.ASCII | re.IGNORECASE)
"""One ``bytes=a-b`` range, ASCII digits only (``str.isdigit`` also accepts '²' and other digits ``int`` rejects)."""
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,15})-([0-9]{1,15})/([0-9]{1,15})", re.ASCII)
_HEX64 = re.compile(r"[0-9a-fA-F]{64}", re.ASCII)
_CHECKSUM = re.compile(r"([a-z0-9]{1,16})=([A-Za-z0-9+/]{4,64}={0,2})", re.ASCII)
"""``<algorithm>=<base64>``, as S3 names its checksum headers (``x-amz-checksum-<algorithm>: <base64>``)."""
_TOKEN = re.compile(r"(?:([a-z0-9]{1,16}):)?([0-9a-f]{16,128})", re.ASCII)
_UINT = re.compile(r"[0-9]{1,18}", re.ASCII)
_TOKEN_IDS = re.compile(rf"[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}(?:,[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}})*", re.ASCII)
_PARENT = re.compile(r"(?:[0-9a-fA-F]{2}){8,32}", re.ASCII)
"""A block hash: whole bytes of hex, 8 to 32 of them (an odd length is no hash, and no vLLM event could carry it)."""
_CHECKSUM_PATTERN = r"^(?:crc64nvme=[A-Za-z0-9+/]{10}|sha256=[A-Za-z0-9+/]{42})[AEIMQUYcgkosw048]=$"
"""A checksum header as :func:`parse_checksum` takes it: an algorithm kvgate speaks and its value in canonical base64
(8 and 32 bytes both end in one ``=`` after a character whose two unused bits are 0)."""
HEADER_PATTERNS = {
    "Range": r"^[Bb][Yy][Tt][Ee][Ss]=(?:[0-9]{1,18}-[0-9]{0,18}|-[0-9]{1,18})$",
    "Content-Range": f"^{_CONTENT_RANGE.pattern}$",
    CHECKSUM_HEADER: _CHECKSUM_PATTERN,
    PART_CHECKSUM_HEADER: _CHECKSUM_PATTERN,
    DIGEST_HEADER: f"^{_HEX64.pattern}$",
    PART_DIGEST_HEADER: f"^{_HEX64.pattern}$",
    "If-None-Match": r"^\*$",
    "Last-Event-ID": f"^{_UINT.pattern}$",
}
"""Request headers with a grammar, as JSON Schema (ECMA-262) patterns for the OpenAPI spec: what the parsers above
take (an algorithm's name and its value's length are checked past the pattern)."""
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +([A-Za-z0-9._~+/-]{1,512}=*) *", re.ASCII)
"""RFC 6750's ``Bearer b64token``, at most 512 characters."""
_JSON_NESTING = re.compile(rb'[\[\]{}"\\]')


class WireError(ValueError):
    """A header value kvgate cannot use."""


class MalformedHeader(WireError):
    """Not the grammar kvgate speaks (a 400 at the gateway)."""


class MalformedBody(WireError):
    """A request body that is not the bounded JSON kvgate reads (a 400 at the gateway)."""


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
    """The strong ETag of an object whose checksum token (``Checksum.token``) is ``digest``."""
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


# -- checksums: X-KVGate-Checksum, its part and range siblings, the ETag ------------------------------------------


@dataclass(frozen=True, slots=True)
class Checksum:
    """An object's (or a part's, or a range's) checksum: the algorithm and its value as lower-case hex.

    Three spellings: the header's ``crc64nvme=<base64>`` (``header``); the ``token`` the index keeps and the ETag
    quotes, ``crc64nvme:<hex>``, where a sha256 is its bare 64 hex digits as kvgate always wrote it (so a row or an
    ETag from before other algorithms reads as what it is, and no other token can be mistaken for a sha256); and the
    raw bytes (``raw``)."""

    algorithm: str
    hex: str

    def __post_init__(self) -> None:
        size = ALGORITHMS.get(self.algorithm)
        if size is None or len(self.hex) != 2 * size or _TOKEN.fullmatch(self.hex) is None:
            raise ValueError(f"not a {self.algorithm} value: {self.hex[:80]!r}")

    @classmethod
    def of(cls, algorithm: str, raw: bytes | int) -> Checksum:
        """From the algorithm's raw value (bytes, or a CRC as an int)."""
        size = ALGORITHMS[algorithm]
        if isinstance(raw, int):
            raw = raw.to_bytes(size, "big")
        return cls(algorithm, raw.hex())

    @property
    def raw(self) -> bytes:
        return bytes.fromhex(self.hex)

    @property
    def crc(self) -> int:
        """The value as an unsigned integer (a CRC's own form)."""
        return int(self.hex, 16)

    @property
    def header(self) -> str:
        """``<algorithm>=<base64>``: the value of X-KVGate-Checksum and its siblings."""
        return f"{self.algorithm}={base64.b64encode(self.raw).decode('ascii')}"

    @property
    def token(self) -> str:
        """What the index keeps and the ETag quotes: bare hex for a sha256, ``<algorithm>:<hex>`` otherwise."""
        return self.hex if self.algorithm == SHA256 else f"{self.algorithm}:{self.hex}"

    @property
    def etag(self) -> str:
        return quote_etag(self.token)


def parse_checksum(value: str, *, header: str = CHECKSUM_HEADER) -> Checksum:
    """``<algorithm>=<base64>`` -> Checksum; MalformedHeader for another grammar, an unknown algorithm, or a value
    of the wrong length for its algorithm."""
    m = _CHECKSUM.fullmatch(value.strip())
    if m is None:
        raise MalformedHeader(f"{header} must be '<algorithm>=<base64>', e.g. '{CRC64NVME}=AAAAAAAAAAA='")
    algorithm = m[1]
    if algorithm not in ALGORITHMS:
        raise MalformedHeader(f"{header}: unknown algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    try:
        raw = base64.b64decode(m[2], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MalformedHeader(f"{header}: the value is not base64") from exc
    if len(raw) != ALGORITHMS[algorithm]:
        raise MalformedHeader(f"{header}: a {algorithm} value is {ALGORITHMS[algorithm]} bytes, got {len(raw)}")
    if base64.b64encode(raw).decode("ascii") != m[2]:
        raise MalformedHeader(f"{header}: the value is not canonical base64 (its unused bits must be 0)")
    return Checksum.of(algorithm, raw)


def parse_checksum_token(token: str) -> Checksum:
    """A ``Checksum.token`` (as the index keeps it and the ETag quotes it) -> Checksum; ValueError otherwise."""
    m = _TOKEN.fullmatch(token)
    if m is None:
        raise ValueError(f"not a checksum token: {token[:80]!r}")
    return Checksum(m[1] or SHA256, m[2])


def etag_checksum(value: str | None) -> Checksum | None:
    """The checksum a strong ETag of kvgate's names; None for none, a weak one, or one that names no checksum."""
    token = unquote_etag(value)
    if token is None:
        return None
    try:
        return parse_checksum_token(token)
    except ValueError:
        return None


def parse_request_checksum(
    value: str | None, legacy: str | None, *, header: str = CHECKSUM_HEADER, legacy_header: str = DIGEST_HEADER
) -> Checksum | None:
    """A PUT's checksum, from ``X-KVGate-Checksum`` (or its part sibling) or an earlier client's hex sha256 header;
    None when neither is sent. Both sent must agree (MalformedHeader otherwise)."""
    new = None if value is None else parse_checksum(value, header=header)
    old = parse_digest(legacy, header=legacy_header)
    if old is None:
        return new
    if new is not None and new != Checksum(SHA256, old):
        raise MalformedHeader(f"{header} and {legacy_header} disagree")
    return Checksum(SHA256, old)


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
    value = BlockMetaValue(parent=parent.hex() if isinstance(parent, bytes) else parent, tokens=tuple(tokens)).header()
    return value if value and len(value) <= MAX_BLOCK_META_BYTES else None


# -- numbers, block meta, bearer tokens (request headers and query values) ------------------------------------------


def parse_uint(value: str, *, what: str) -> int:
    """A non-negative integer of at most 18 ASCII digits (below 2**63), nothing around it."""
    if not _UINT.fullmatch(value):
        raise MalformedHeader(f"{what} must be a non-negative integer of at most 18 digits, got {value[:40]!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class BlockMetaValue:
    """What ``X-KVGate-Block-Meta`` says of a block: its parent's hash (lower case) and its token ids."""

    parent: str | None
    tokens: tuple[int, ...]

    def header(self) -> str:
        """The header's value that says this (``parse_block_meta`` reads it back equal; "" when it says nothing).
        Also the block meta's one stored form: the event log keeps it as this string (app/index/eventlog.py), so a
        new field is written here and in app/events only."""
        parts = []
        if self.parent is not None:
            parts.append(f"parent={self.parent}")
        if self.tokens:
            parts.append("tokens=" + ",".join(map(str, self.tokens)))
        return "; ".join(parts)


def parse_block_meta(value: str) -> BlockMetaValue:
    """``parent=<hex>; tokens=1,2,3`` (either part may be left out, empty parts are ignored), at most 8 KiB and
    1,024 token ids of at most 11 digits each; the parent is whole bytes of hex, 8 to 32 of them."""
    if len(value) > MAX_BLOCK_META_BYTES:
        raise MalformedHeader(f"{BLOCK_META_HEADER} is over {MAX_BLOCK_META_BYTES} bytes")
    parent: str | None = None
    tokens: tuple[int, ...] = ()
    for part in value.split(";"):
        name, sep, text = part.strip(" \t").partition("=")
        if not sep:
            if name:
                raise MalformedHeader(f"{BLOCK_META_HEADER}: expected name=value, got {name[:40]!r}")
            continue
        if name == "parent":
            if text and not _PARENT.fullmatch(text):
                raise MalformedHeader(f"{BLOCK_META_HEADER}: parent must be a block hash (16-64 hex, whole bytes)")
            parent = text.lower() or None
        elif name == "tokens":
            if text and (text.count(",") >= MAX_BLOCK_META_TOKENS or not _TOKEN_IDS.fullmatch(text)):
                raise MalformedHeader(
                    f"{BLOCK_META_HEADER}: tokens must be at most {MAX_BLOCK_META_TOKENS} non-negative integers of "
                    f"at most {MAX_TOKEN_ID_DIGITS} digits"
                )
            tokens = tuple(int(t) for t in text.split(",")) if text else ()
        else:
            raise MalformedHeader(f"{BLOCK_META_HEADER}: unknown field {name[:40]!r}")
    return BlockMetaValue(parent=parent, tokens=tokens)


def parse_bearer(value: str) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None for any other value (another scheme, no token, a token
    that is not RFC 6750's ASCII b64token): no principal, a 401."""
    m = _BEARER.fullmatch(value)
    return m[1] if m is not None else None


# -- JSON bodies ---------------------------------------------------------------------------------------------------


def _refuse_constant(name: str) -> Any:
    raise MalformedBody(f"{name} is not JSON")


def parse_json(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON document (UTF-8) nested at most ``max_depth`` deep, with no NaN/Infinity and no integer over 4,300
    digits; MalformedBody otherwise. The depth is checked before parsing, so no input reaches the parser's
    recursion limit."""
    depth, in_string, skip = 0, False, -1
    for m in _JSON_NESTING.finditer(body):  # only brackets, quotes and backslashes: cheap on long key lists
        at = m.start()
        if at == skip:  # the character a backslash escapes
            continue
        c = body[at]
        if in_string:
            if c == 0x5C:  # backslash
                skip = at + 1
            elif c == 0x22:  # the closing quote
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > max_depth:
                raise MalformedBody(f"JSON nested deeper than {max_depth}")
        elif c in (0x5D, 0x7D):  # ] }
            depth -= 1
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise MalformedBody(f"not a JSON document: {str(exc)[:120]}") from exc
