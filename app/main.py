"""create_app(settings): the lifespan builds store, index and service; routes, middleware and the error table are
wired. create_server(settings): that app in the server ``kvgate serve`` runs."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from types import FrameType
from typing import Any

from fastapi import FastAPI

from app import __version__
from app.api import errors, openapi
from app.api.middleware import auth, limits, metrics
from app.api.middleware.principals import Principals
from app.api.routes import admin, blocks, docs, events, health, lookup, namespaces
from app.api.routes import metrics as metrics_route
from app.api.routes.thin import BlockFastPath
from app.api.server.get_lane import GetLane
from app.api.server.lanes import HeadLane
from app.api.server.put_lane import PutLane
from app.api.server.runner import GatewayServer, build_server, check_serving
from app.api.server.supervisor import Supervisor, bind_sockets
from app.backends import Backends, open_backends
from app.config import Settings
from app.core.assembly import open_core
from app.core.event_sink import NO_EVENTS
from app.core.reconcile import reconcile
from app.errors import BackendUnavailable
from app.events.feed import EventFeed
from app.events.setup import event_parts, open_events
from app.index.engine import unreachable

log = logging.getLogger("kvgate")

DESCRIPTION = """
KV-cache block gateway for LLM inference. vLLM nodes store the KV cache of prompt prefixes here and load it back,
keyed by vLLM's FileMapper paths. Errors are `{"error": {"code", "message"}}`; a miss is a 404, an outage a 503.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    cfg = settings or Settings()
    return _app(cfg, principals=_principals(cfg))


def create_server(settings: Settings | None = None) -> GatewayServer:
    """The app in its server (uvicorn, the bounded protocol, TLS), with the TLS files and the tokens file reloaded
    on SIGHUP and on change; ValueError when the start-up rules refuse the settings."""
    cfg = settings or Settings()
    principals = _principals(cfg)
    app = _app(cfg, principals=principals)
    prefix = blocks.router.prefix + "/"
    lane = (
        HeadLane(state=app.state, routes=blocks.router.routes, prefix=prefix, principals=principals)
        if cfg.head_lane
        else None
    )
    put_lane = (
        PutLane(
            state=app.state,
            app=app,
            routes=blocks.router.routes,
            prefix=prefix,
            principals=principals,
            max_bytes=cfg.max_block_bytes,
        )
        if cfg.put_lane
        else None
    )
    get_lane = (
        GetLane(state=app.state, routes=blocks.router.routes, prefix=prefix, principals=principals)
        if cfg.get_lane
        else None
    )
    return build_server(app=app, settings=cfg, principals=principals, lane=lane, put_lane=put_lane, get_lane=get_lane)


def serve_workers(settings: Settings, *, env: Mapping[str, str]) -> int:
    """``kvgate serve --workers N``: the supervisor of N gateway processes, one listening socket each on the same
    address (app/api/server/supervisor.py); each worker is ``python -m app serve --listen-fd FD`` with this
    environment and ``env`` (the settings given as flags). The exit status: 2 when the start-up rules refuse the
    settings or the address cannot be bound, else the supervisor's."""
    try:
        warnings = check_serving(settings)
        socks = bind_sockets(settings.host, settings.port, count=settings.workers)
    except (ValueError, OSError) as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"kvgate: WARNING: {warning}", file=sys.stderr)
    logging.basicConfig(level=logging.DEBUG if settings.log_level == "trace" else settings.log_level.upper())
    print(f"kvgate: {settings.workers} workers on {settings.host}:{socks[0].getsockname()[1]}", file=sys.stderr)
    return Supervisor(
        socks=socks,
        command=lambda fd: [sys.executable, "-m", "app", "serve", "--listen-fd", str(fd)],
        env={**os.environ, **env, "KVGATE_WORKERS": "1"},
        # the first generation reconciles once (its first worker); a replacement of a dead worker reconciles itself
        first_env={"KVGATE_RECONCILE_ON_START": "false"},
    ).run()


def _principals(cfg: Settings) -> Principals | None:
    """Who may call, when any principal can be configured (a tokens file that is empty for now denies everyone)."""
    return Principals(settings=cfg) if cfg.tokens or cfg.tokens_file is not None else None


def _app(cfg: Settings, *, principals: Principals | None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _started(app, cfg=cfg):
            yield

    app = FastAPI(
        title="kvgate",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # served by app.api.routes.docs from packaged assets, not a CDN
        redoc_url=None,
        # kvgate's metrics are its own (Prometheus, /metrics); FastAPI's OpenTelemetry would look for its providers
        # in every request (the global providers): CPU on every request, for nothing
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.settings = cfg
    errors.install(app)
    docs.install(app)
    for module in (blocks, lookup, namespaces, admin, events, health):
        app.include_router(module.router)
    app.add_middleware(
        BlockFastPath, routes=blocks.router.routes, prefix=blocks.router.prefix + "/"
    )  # innermost: the data path's dispatch
    limits.install(app, cfg)  # inside auth: an unauthenticated request takes no upload slot
    auth.install(app, principals, cfg)
    if cfg.metrics_enabled:
        metrics.install(app)  # outermost: it counts every answer, refusals included
        app.include_router(metrics_route.router)
    openapi.install(app, cfg, secured=principals is not None)
    return app


def _restart() -> None:
    """The coordination file was removed or replaced under this worker: stop (gracefully; the supervisor, or the
    service manager, starts another, which opens the file that is there now)."""
    log.error("coordination file removed or replaced: refusing changes, restarting")
    os.kill(os.getpid(), signal.SIGTERM)


STARTUP_RETRY_S = (0.5, 5.0)
"""Start-up's first wait between tries, and the longest (doubling in between)."""


@contextlib.asynccontextmanager
async def _started(app: FastAPI, *, cfg: Settings) -> AsyncIterator[None]:
    """The backends opened and the core serving, tried again while the index or the store cannot be reached yet,
    for up to ``startup_wait_s`` (a gateway started beside its PostgreSQL waits for it, as a client would)."""
    deadline = time.monotonic() + cfg.startup_wait_s
    pause = STARTUP_RETRY_S[0]
    while True:
        stack = contextlib.AsyncExitStack()
        try:
            backends = await stack.enter_async_context(open_backends(cfg))
            await stack.enter_async_context(_serving(app, cfg=cfg, backends=backends, until=deadline))
        except Exception as exc:
            with contextlib.suppress(Exception):
                await stack.aclose()
            if not (isinstance(exc, BackendUnavailable) or unreachable(exc)) or time.monotonic() + pause > deadline:
                raise
            log.warning("start-up: %s: %s; trying again in %.1f s", type(exc).__name__, exc, pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, STARTUP_RETRY_S[1])
            continue
        async with stack:
            yield
        return


@contextlib.asynccontextmanager
async def _serving(app: FastAPI, *, cfg: Settings, backends: Backends, until: float) -> AsyncIterator[None]:
    """The core over the opened backends, with events, reconcile and capacity; closed in reverse. The steps that
    may be repeated (reconcile's snapshot and listing, the usage read) are each tried again in place until
    ``until`` (app/core/patience.py): a lost reply there does not begin start-up again from the top."""
    parts = await event_parts(cfg, index=backends.index)
    app.state.events = None
    async with (
        open_core(
            backends,
            settings=cfg,
            events=parts.writer if parts is not None else NO_EVENTS,
            on_coordination_lost=_restart,
        ) as core,
        contextlib.AsyncExitStack() as stack,
    ):
        if cfg.reconcile_on_start:
            await reconcile(
                upkeep=core.upkeep,
                store=core.store,
                index=core.index,
                concurrency=cfg.reconcile_concurrency,
                stale_parts_s=cfg.stale_upload_s,
                until=until,
            )
        await core.capacity.start(until=until)
        await core.scrub.start()
        if parts is not None:
            events = await stack.enter_async_context(
                open_events(cfg, parts=parts, index=core.index, coordinator=core.coordinator)
            )
            app.state.events = events.feed
            _end_streams_on_exit(events.feed)
        app.state.core = core
        app.state.started_at = time.monotonic()
        # Everything built so far (modules, FastAPI's routes and models, SQLAlchemy's tables, botocore's service
        # model) lives as long as the process. Frozen out of the collector's reach, it is no longer walked by a
        # full collection, during which the event loop stands still (python -m benchmarks.gateway.gc_pause: fresh
        # and with the metadata cache full, frozen and not). Full collections are rare in steady state but come with
        # bursts of new long-lived objects, such as a filling cache.
        gc.collect()  # start-up's own cyclic garbage is collected, not frozen with the rest
        gc.freeze()
        log.info("kvgate ready backend=%s index=%s", cfg.backend.kind, cfg.resolved_db_url.split("://")[0])
        try:
            yield
        finally:
            gc.unfreeze()  # back to the oldest generation: an app started again in this process freezes anew


def _end_streams_on_exit(feed: EventFeed) -> None:
    """uvicorn waits for open responses before it stops: end the event streams when it is told to stop."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue

        def handler(signum: int, frame: FrameType | None, previous: Callable[..., Any] = previous) -> None:
            loop.call_soon_threadsafe(feed.end_streams)
            previous(signum, frame)

        with contextlib.suppress(ValueError):  # not the main thread (an in-process test client): nothing to chain
            signal.signal(sig, handler)
