"""The server ``kvgate serve`` runs, assembled from Settings: uvicorn on uvloop with the httptools protocol made
bounded (:mod:`app.api.server.head_limits`) and zero-copy (:mod:`app.api.server.http_body`), the peer certificate
in the scope when client certificates are on, the TLS context and its reloader (SIGHUP, file watch).

:func:`build_server` is the one place this is put together; ``kvgate serve`` runs what it returns, and a test can
run the same thing on a loopback port in its own thread (:meth:`GatewayServer.serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass, field

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.api.server.bind import bind_warnings, check_bind
from app.api.server.head_limits import bounded_httptools
from app.api.server.http_body import zero_copy_body
from app.api.server.tls import CertReloader, server_context, with_peer_cert
from app.config import Settings


def http_protocol(settings: Settings) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with kvgate's head bounds, zero-copy bodies and (with client certificates) the
    peer certificate in every scope."""
    http = zero_copy_body(
        bounded_httptools(max_header_bytes=settings.max_header_bytes, header_timeout_s=settings.header_timeout_s)
    )
    return with_peer_cert(http) if settings.tls_client_ca is not None else http


@dataclass
class GatewayServer:
    """A uvicorn server ready to run, with the certificate reloader beside it (None without TLS)."""

    server: uvicorn.Server
    reloader: CertReloader | None
    warnings: list[str] = field(default_factory=list)
    """What the start-up rules warn about (printed by ``kvgate serve``)."""

    async def serve(self) -> None:
        """Serve until told to stop (``server.should_exit``, or SIGINT/SIGTERM in the main thread)."""
        watcher: asyncio.Task[None] | None = None
        reloader = self.reloader
        if reloader is not None:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError, AttributeError, ValueError, RuntimeError):
                loop.add_signal_handler(signal.SIGHUP, lambda: reloader.reload(why="SIGHUP"))
            interval = reloader.settings.tls_reload_interval_s
            if interval > 0:
                watcher = asyncio.create_task(reloader.watch(interval_s=interval))
        try:
            await self.server.serve()
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher

    def run(self) -> bool:
        """Serve on the configured loop (uvloop) until stopped; whether the server started (``uvicorn.run`` exits
        with status 3 when it did not)."""
        with asyncio.Runner(loop_factory=self.server.config.get_loop_factory()) as runner:
            runner.run(self.serve())
        return bool(self.server.started)


def build_server(*, app: ASGIApp, settings: Settings) -> GatewayServer:
    """The server for ``app`` as ``settings`` describe it; ValueError (with the reason) when the start-up rules
    refuse the bind or a TLS file cannot be loaded."""
    check_bind(settings)
    warnings = bind_warnings(settings)
    context = server_context(settings) if settings.tls_enabled else None
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=http_protocol(settings),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        limit_concurrency=settings.limit_concurrency,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=30,
        ssl_context_factory=(lambda _config, _default: context) if context is not None else None,
    )
    reloader = CertReloader(context=context, settings=settings) if context is not None else None
    return GatewayServer(server=uvicorn.Server(config), reloader=reloader, warnings=warnings)
