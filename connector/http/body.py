"""A block's bytes on the wire, both ways. Out: a PUT's body sent from the caller's buffer as it is
(:class:`BlockPayload`). In: what a block GET's answer must be before its bytes are used: the Range header asked
with, the body read (joined once, or straight into the caller's buffer), and the checks: a whole object against the
version's checksum, a 206 against the gateway's checksum of exactly the range, a 200 answer to a range request as
the whole object, then sliced. An answer with nothing to check against is refused."""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
from aiohttp.abc import AbstractStreamWriter

from connector.http.checksums import checksum_off_loop
from contract import wire
from contract.wire import CHECKSUM_HEADER, RANGE_CHECKSUM_HEADER, RANGE_DIGEST_HEADER, SHA256, Checksum, WireError


class BlockPayload(aiohttp.BytesPayload):
    """A PUT body written to the connection as the caller's buffer, after the request head, never joined with it.

    aiohttp sends a request's head together with the first body chunk; where ``transport.writelines`` is unsafe
    (Python before 3.12.9) it does so with ``b"".join((head, body))``: a copy of the whole block into a fresh
    allocation, whose pages fault in, for every PUT. Writing an empty chunk first sends the head alone; the body
    then goes to ``transport.write`` as it is (a memoryview of the caller's buffer is not copied unless the socket
    takes only part of it). Same bytes on the wire (``tests/connector/test_block_payload.py``)."""

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        view = memoryview(self._value)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")  # bytes, whatever the buffer's items (a tensor's memory: floats, 2-D)
        if content_length is not None and content_length < view.nbytes:
            view = view[:content_length]
        await writer.write(b"")  # the head alone (aiohttp keeps it until the first chunk)
        await writer.write(view)


def range_header(byte_range: tuple[int, int] | None) -> dict[str, str]:
    return {} if byte_range is None else {"Range": wire.format_range(start=byte_range[0], end=byte_range[1])}


async def read_all(resp: aiohttp.ClientResponse) -> bytes:
    """The response's body, joined once: ``resp.read()`` joins what arrived between reads, then joins those again
    (two copies of a 2 MiB block, each a fresh allocation whose pages fault in)."""
    pieces = [data async for data, _ in resp.content.iter_chunks()]
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def read_into(resp: aiohttp.ClientResponse, into: memoryview) -> int:
    """Copy the body into ``into`` as it arrives; its length, or -1 once it outgrows ``into``."""
    pos = 0
    async for chunk in resp.content.iter_any():
        end = pos + len(chunk)
        if end > into.nbytes:
            return -1
        into[pos:end] = chunk
        pos = end
    return pos


async def checked(
    *,
    status: int,
    headers: Mapping[str, str],
    body: memoryview,
    byte_range: tuple[int, int] | None,
    expected_digest: str | None,
) -> memoryview | str:
    """The wanted bytes of a 200 or 206 answer's ``body``, verified, or why they must not be used.

    A 200 is the whole object (also from an intermediary that dropped the Range): checked against
    ``expected_digest`` (a checksum token, e.g. from a lookup) or, failing that, the version's checksum the gateway
    sends (``X-KVGate-Checksum``, else the ETag), then sliced. A 206 must be exactly the range asked for, checked
    against ``X-KVGate-Range-Checksum`` (or an earlier gateway's ``X-KVGate-Range-SHA256``)."""
    if status == 206:
        why = await _check_range(headers, body, byte_range)
        return body if why is None else why
    why = await _check_whole(headers, body, expected_digest)
    if why is not None:
        return why
    if byte_range is None:
        return body
    start, end = byte_range
    if body.nbytes < end:
        return f"short read: {body.nbytes} bytes, the range ends at {end}"
    return body[start:end]


def _answer_checksum(headers: Mapping[str, str], name: str) -> Checksum | None:
    """The checksum a response header carries (``<algorithm>=<base64>``); None when absent or not kvgate's grammar."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        return wire.parse_checksum(value, header=name)
    except WireError:
        return None


async def _mismatch(body: memoryview, want: Checksum) -> str | None:
    got = await checksum_off_loop(body, want.algorithm)
    return None if got == want else f"{want.algorithm} {got.hex} is not the gateway's {want.hex}"


async def _check_whole(headers: Mapping[str, str], body: memoryview, expected: str | None) -> str | None:
    """Why a 200's body is not the version it says it is (None: it is)."""
    want: Checksum | None
    if expected is not None:
        try:
            want = wire.parse_checksum_token(expected.lower())
        except ValueError:
            return f"cannot check against {expected[:80]!r}"
    else:
        want = _answer_checksum(headers, CHECKSUM_HEADER) or wire.etag_checksum(headers.get("ETag"))
    if want is None:
        return "the answer carries no checksum to check the body against"
    return await _mismatch(body, want)


async def _check_range(headers: Mapping[str, str], body: memoryview, byte_range: tuple[int, int] | None) -> str | None:
    """Why a 206's body is not the range asked for, vouched for by the gateway (None: it is)."""
    if byte_range is None:
        return "a 206 answer to a request for the whole object"
    start, end = byte_range
    try:
        span = wire.parse_content_range(headers.get("Content-Range", ""))
    except WireError:
        return "a 206 answer without a valid Content-Range"
    if (span.start, span.end) != (start, end) or body.nbytes != end - start:
        return f"asked for bytes {start}-{end - 1}, got {span.start}-{span.end - 1} ({body.nbytes} bytes)"
    want = _answer_checksum(headers, RANGE_CHECKSUM_HEADER)
    if want is None and (legacy := headers.get(RANGE_DIGEST_HEADER)) is not None:  # an earlier gateway
        try:
            want = Checksum(SHA256, legacy.lower())
        except ValueError:
            return f"{RANGE_DIGEST_HEADER} is not a sha256"
    if want is None:
        return "the gateway sent no checksum of the range: it cannot be verified"
    return await _mismatch(body, want)
