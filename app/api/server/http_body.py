"""Request bodies without uvicorn's two extra copies.

uvicorn's httptools protocol appends every network chunk to a ``bytearray`` (copy 1) and hands the app
``bytes(bytearray)`` (copy 2). For a 2 MiB block that is 4 MiB of memcpy and fresh pages per request, a large
share of a PUT's CPU time on a small machine. ``zero_copy_body`` swaps that bytearray for a list of the chunks
httptools already made: ``+=`` keeps a reference, ``bytes()`` returns a lone chunk as it is and joins several.
Flow control (``len()``, the 64 KiB high-water mark) is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class BodyChunks:
    """Stands in for ``RequestResponseCycle.body``: supports ``+=``, ``len()`` and ``bytes()``, as uvicorn uses it."""

    __slots__ = ("_parts", "_size")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def __iadd__(self, chunk: bytes) -> BodyChunks:
        if chunk:
            self._parts.append(chunk)
            self._size += len(chunk)
        return self

    def __len__(self) -> int:
        return self._size

    def chunks(self) -> list[bytes]:
        return self._parts

    def __bytes__(self) -> bytes:
        if len(self._parts) == 1 and type(self._parts[0]) is bytes:
            return self._parts[0]
        return b"".join(self._parts)


def zero_copy_body(base: type[HttpToolsProtocol]) -> type[HttpToolsProtocol]:
    """``base`` (uvicorn's httptools protocol or a subclass of it) keeping body chunks instead of copying them."""

    class ZeroCopyBodyProtocol(base):  # type: ignore[valid-type, misc]
        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if type(cycle.body) is bytearray:  # a new cycle, or receive() just drained it
                pending = bytes(cycle.body)
                cycle.body = BodyChunks()
                cycle.body += pending
            super().on_body(body)

    ZeroCopyBodyProtocol.__name__ = f"ZeroCopy{base.__name__}"
    return ZeroCopyBodyProtocol
