"""HTTP framing fails closed: an answer sent before the request's body was read in full ends the connection.

uvicorn's httptools protocol keeps a connection alive after any answer. When the app answers a request before its
body has arrived (a 401, a 413 on the declared Content-Length, a bad checksum header, a full store), the parser
still expects the rest of that body, so the client's next request on the connection is read as body bytes and
never answered (or, with a chunked body, taken for a chunk size). :func:`fail_closed` makes the request's cycle
not keep-alive from its head until the parser has read its body's last byte (``on_message_complete``, which for a
request without a body comes in the same parse as its head, before the app runs). An answer started in between is
then sent with ``Connection: close`` and the connection is closed after it: uvicorn's own rule for a cycle that
is not keep-alive (the one its graceful shutdown uses).

Closing, not draining the rest: the rest of a body the client may never send (it stopped after the answer, as
``Expect: 100-continue`` clients and many others do) cannot be told apart from its next request, so no bounded
wait makes the connection safe to reuse. An answer after the whole body was parsed (the usual case, a small
refused PUT included) keeps the connection.

Put it under the lanes (app/api/server/lanes.py): a PUT the PUT lane hands to the stack goes through it too.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def fail_closed(base: type[HttpToolsProtocol]) -> type[HttpToolsProtocol]:
    """``base`` (uvicorn's httptools protocol or a subclass) closing the connection after an answer sent before
    the request's body was read in full."""

    parent: Any = base  # a class chosen at run time: its attributes are uvicorn's protocol's

    class FailClosedProtocol(parent):  # type: ignore[misc]
        cycle: Any  # uvicorn's (annotations only: no class attribute)
        _unread: Any = None
        """The cycle whose keep-alive is held back until its body is read in full."""

        def on_headers_complete(self) -> None:
            before = self.cycle
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not before and cycle is not None and cycle.keep_alive:
                cycle.keep_alive = False
                self._unread = cycle

        def on_message_complete(self) -> None:
            cycle = self._unread
            if cycle is not None and cycle is self.cycle:
                self._unread = None
                if not cycle.response_started:  # an answer begun has said Connection: close: it keeps its word
                    cycle.keep_alive = True
            super().on_message_complete()

        def shutdown(self) -> None:
            self._unread = None  # uvicorn's graceful shutdown: the answer closes the connection, whatever is read
            super().shutdown()

    FailClosedProtocol.__name__ = f"FailClosed{base.__name__}"
    return FailClosedProtocol
