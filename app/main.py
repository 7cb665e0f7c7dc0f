"""create_app(settings): the lifespan builds store, index and service; routes and the error table are wired."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from app import __version__
from app.api import blocks, errors, health, lookup, namespaces
from app.config import Settings
from app.index.migrate import upgrade_head
from app.index.repository import Index, make_engine
from app.service import BlockService, MetaCache
from app.storage import build_store

log = logging.getLogger("kvgate")

DESCRIPTION = """
KV-cache block gateway for LLM inference. vLLM nodes store the KV cache of prompt prefixes here and load it back,
keyed by vLLM's FileMapper paths. Errors are `{"error": {"code", "message"}}`; a miss is a 404, an outage a 503.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    cfg = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        store = build_store(cfg.backend, settings=cfg)
        await store.start()
        await upgrade_head(cfg.resolved_db_url)
        index = Index(
            make_engine(cfg.resolved_db_url, sqlite_synchronous=cfg.sqlite_synchronous),
            flush_interval_s=cfg.access_flush_interval_s,
        )
        await index.start()
        app.state.service = BlockService(
            store=store, index=index, cache=MetaCache(entries=cfg.meta_cache_entries, ttl_s=cfg.meta_cache_ttl_s)
        )
        log.info("kvgate ready backend=%s index=%s", cfg.backend.kind, cfg.resolved_db_url.split("://")[0])
        try:
            yield
        finally:
            await index.close()
            await store.close()

    app = FastAPI(title="kvgate", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = cfg
    errors.install(app)
    for module in (blocks, lookup, namespaces, health):
        app.include_router(module.router)
    return app
