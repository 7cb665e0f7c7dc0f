"""The server ``kvgate serve`` runs, assembled from Settings: uvicorn on uvloop with the httptools protocol made
bounded (:mod:`app.api.server.head_limits`), fail-closed (:mod:`app.api.server.framing`) and zero-copy
(:mod:`app.api.server.http_body`), the peer certificate in the scope when client certificates are on, and the
reloaders of the TLS files and the tokens file (SIGHUP, file watch).

:func:`build_server` is the one place this is put together; ``kvgate serve`` runs what it returns, and a test can
run the same thing on a loopback port in its own thread (:meth:`GatewayServer.serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.api.middleware.principals import Principals
from app.api.reloading import Reloader
from app.api.server.bind import bind_warnings, check_bind
from app.api.server.framing import fail_closed
from app.api.server.get_lane import GetLane
from app.api.server.head_limits import bounded_httptools
from app.api.server.http_body import zero_copy_body
from app.api.server.lanes import HeadLane, with_lanes
from app.api.server.put_lane import PutLane
from app.api.server.tls import TlsContexts, with_peer_cert
from app.config import Settings


def http_protocol(
    settings: Settings,
    *,
    lane: HeadLane | None = None,
    put_lane: PutLane | None = None,
    get_lane: GetLane | None = None,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with kvgate's head bounds, framing that fails closed, zero-copy bodies, (with
    client certificates) the peer certificate in every scope, and the lanes once the bounds are checked: ``lane``
    answering HEADs of cached blocks, ``put_lane`` storing whole small blocks, ``get_lane`` sending whole cached
    blocks, over plain HTTP only (app/api/server/lanes.py)."""
    base = fail_closed(HttpToolsProtocol)  # under the lanes: a PUT the PUT lane hands to the stack goes through it
    if settings.tls_enabled:
        get_lane = None  # TLS encrypts in user space: a file cannot go to the socket as it is
    if lane is not None or put_lane is not None or get_lane is not None:
        base = with_lanes(base, head=lane, put=put_lane, get=get_lane)
    http = zero_copy_body(
        bounded_httptools(
            max_header_bytes=settings.max_header_bytes, header_timeout_s=settings.header_timeout_s, base=base
        )
    )
    return with_peer_cert(http) if settings.tls_client_ca is not None else http


@dataclass
class GatewayServer:
    """A uvicorn server ready to run, with the reloaders of the files it serves by (TLS files, tokens file)."""

    server: uvicorn.Server
    reloaders: list[Reloader[Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What the start-up rules warn about (printed by ``kvgate serve``)."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until told to stop (``server.should_exit``, or SIGINT/SIGTERM in the main thread); SIGHUP reloads
        every file, and each reloader with an interval watches its files. ``sockets``: listen on these (a worker of
        ``kvgate serve --workers``) instead of binding the configured address."""
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task[bool]] = set()

        def on_sighup() -> None:
            for reloader in self.reloaders:
                task = loop.create_task(reloader.reload(why="SIGHUP"))
                running.add(task)
                task.add_done_callback(running.discard)

        if self.reloaders:
            with contextlib.suppress(NotImplementedError, AttributeError, ValueError, RuntimeError):
                loop.add_signal_handler(signal.SIGHUP, on_sighup)  # the main thread only
        watchers = [asyncio.create_task(r.watch()) for r in self.reloaders if r.interval_s > 0]
        try:
            await self.server.serve(sockets=sockets)
        finally:
            for task in watchers:
                task.cancel()
            for task in watchers:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def run(self, sockets: list[socket.socket] | None = None) -> bool:
        """Serve on the configured loop (uvloop) until stopped; whether the server started (``uvicorn.run`` exits
        with status 3 when it did not)."""
        with asyncio.Runner(loop_factory=self.server.config.get_loop_factory()) as runner:
            runner.run(self.serve(sockets))
        return bool(self.server.started)


def check_serving(settings: Settings) -> list[str]:
    """The start-up rules (the bind, TLS): their warnings, or ValueError with the reason they refuse to serve, and
    the TLS files loaded once (a file that cannot be loaded is a ValueError naming it)."""
    check_bind(settings)
    warnings = bind_warnings(settings)
    if settings.tls_enabled:
        TlsContexts(settings=settings)
    return warnings


def build_server(
    *,
    app: ASGIApp,
    settings: Settings,
    principals: Principals | None,
    lane: HeadLane | None = None,
    put_lane: PutLane | None = None,
    get_lane: GetLane | None = None,
) -> GatewayServer:
    """The server for ``app`` as ``settings`` describe it (``principals``: the table the app's auth checks, reloaded
    with the TLS files; ``lane``: the app's HEAD lane, None for none); ValueError (with the reason) when the
    start-up rules refuse the bind or a TLS file cannot be loaded."""
    check_bind(settings)
    warnings = bind_warnings(settings)
    tls = TlsContexts(settings=settings) if settings.tls_enabled else None
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        root_path=settings.root_path,
        loop="uvloop",
        http=http_protocol(settings, lane=lane, put_lane=put_lane, get_lane=get_lane),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        limit_concurrency=settings.limit_concurrency,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=30,
        ssl_context_factory=(lambda _config, _default: tls.listening) if tls is not None else None,
    )
    reloaders: list[Reloader[Any]] = [tls] if tls is not None else []
    if principals is not None and settings.tokens_file is not None:
        reloaders.append(principals)
    return GatewayServer(server=uvicorn.Server(config), reloaders=reloaders, warnings=warnings)
