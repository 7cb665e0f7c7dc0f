"""The gateway in this process: ``create_app(Settings(...))`` with its lifespan run, driven through httpx's ASGI
transport. No socket, no subprocess: the service, parts, capacity, auth and limits at the speed of a function call.

The store is the memory store (or a filesystem store under tmp_path) and the index a SQLite file under tmp_path, as
the server has them; what this cannot see (uvicorn's protocol, header limits, a crash) stays in the end-to-end tests.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from app.config import FsBackend, MemoryBackend, Settings
from app.core.eviction import Capacity
from app.core.service import BlockService
from app.index.migrate import upgrade_head
from app.main import create_app


@dataclass
class Gateway:
    """An app whose lifespan is running, and a client that speaks to it."""

    app: FastAPI
    client: httpx.AsyncClient

    @property
    def service(self) -> BlockService:
        svc: BlockService = self.app.state.service
        return svc

    @property
    def capacity(self) -> Capacity:
        cap: Capacity = self.app.state.capacity
        return cap

    async def stats(self, *, headers: dict[str, str] | None = None) -> dict[str, Any]:
        r = await self.client.get("/v1/stats", headers=headers)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out


def settings_for(tmp_path: Path, *, fs: bool = False, **fields: Any) -> Settings:
    """Settings of an in-process gateway: memory (or fs) store, SQLite index under tmp_path, no background work
    that a test did not ask for."""
    backend = FsBackend(root=tmp_path / "blocks", fsync=False) if fs else MemoryBackend()
    base: dict[str, Any] = {
        "data_dir": tmp_path,
        "backend": backend,
        "sqlite_synchronous": "OFF",
        "events_enabled": False,
        "tokens": [],
        "tokens_file": None,
    }
    return Settings(**(base | fields))


_template: list[Path] = []


async def _migrated_index(dest: Path) -> None:
    """Copy an index migrated once per session to ``dest`` (the lifespan's migration then finds nothing to do)."""
    if not _template:
        where = Path(tempfile.mkdtemp(prefix="kvgate-unit-index-"))
        atexit.register(shutil.rmtree, where, ignore_errors=True)
        await upgrade_head(f"sqlite+aiosqlite:///{where / 'index.db'}")
        _template.append(where / "index.db")
    for suffix in ("", "-wal"):
        src = _template[0].with_name(_template[0].name + suffix)
        if src.exists():
            shutil.copyfile(src, dest.with_name(dest.name + suffix))


@contextlib.asynccontextmanager
async def running(settings: Settings, *, headers: dict[str, str] | None = None) -> AsyncIterator[Gateway]:
    """Start the app's lifespan (store, index, service, capacity) and yield a client bound to it in-process."""
    index_file = settings.data_dir / "index.db"
    if settings.db_url is None and not index_file.exists():
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        await _migrated_index(index_file)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgate.test", headers=headers) as client:
            yield Gateway(app=app, client=client)
