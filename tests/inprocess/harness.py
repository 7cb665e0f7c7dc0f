"""The gateway in this process: ``create_app(Settings(...))`` with its lifespan run, driven through httpx's ASGI
transport. No socket, no subprocess: the service, parts, capacity, auth and limits at the speed of a function call.

The store is the memory store (or a filesystem store under tmp_path) and the index a SQLite file under tmp_path, as
the server has them. :func:`served` runs the whole server (``create_server``, what ``kvgate serve`` runs) in a thread
on a loopback port, for uvicorn's protocol and header limits; a crash stays in the end-to-end tests.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from app.api.server.runner import GatewayServer
from app.config import FsBackend, MemoryBackend, Settings
from app.core.assembly import Core
from app.core.capacity import Capacity
from app.core.service import BlockService
from app.index.migrate import upgrade_head
from app.main import create_app, create_server


@dataclass
class InProcessGateway:
    """An app whose lifespan is running, and a client that speaks to it."""

    app: FastAPI
    client: httpx.AsyncClient

    @property
    def core(self) -> Core:
        core: Core = self.app.state.core
        return core

    @property
    def service(self) -> BlockService:
        return self.core.service

    @property
    def capacity(self) -> Capacity:
        return self.core.capacity

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
        where = Path(tempfile.mkdtemp(prefix="kvgate-inprocess-index-"))
        atexit.register(shutil.rmtree, where, ignore_errors=True)
        await upgrade_head(f"sqlite+aiosqlite:///{where / 'index.db'}")
        _template.append(where / "index.db")
    for suffix in ("", "-wal"):
        src = _template[0].with_name(_template[0].name + suffix)
        if src.exists():
            shutil.copyfile(src, dest.with_name(dest.name + suffix))


@contextlib.asynccontextmanager
async def running(settings: Settings, *, headers: dict[str, str] | None = None) -> AsyncIterator[InProcessGateway]:
    """Start the app's lifespan (store, index, service, capacity) and yield a client bound to it in-process."""
    index_file = settings.data_dir / "index.db"
    if settings.db_url is None and not index_file.exists():
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        await _migrated_index(index_file)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgate.test", headers=headers) as client:
            yield InProcessGateway(app=app, client=client)


@contextlib.contextmanager
def served(settings: Settings, *, timeout_s: float = 30.0) -> Iterator[str]:
    """The server ``kvgate serve`` runs (``create_server``: uvicorn, the bounded httptools protocol, TLS when set),
    in a thread of this process on a loopback port; yields its base URL and stops it on exit."""
    with served_server(settings, timeout_s=timeout_s) as (url, _server):
        yield url


@contextlib.contextmanager
def served_server(settings: Settings, *, timeout_s: float = 30.0) -> Iterator[tuple[str, GatewayServer]]:
    """:func:`served`, with the running server (its protocol class, its app) as well."""
    if settings.db_url is None and not (settings.data_dir / "index.db").exists():
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        asyncio.run(_migrated_index(settings.data_dir / "index.db"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    gateway = create_server(settings.model_copy(update={"host": "127.0.0.1", "port": port}))
    thread = threading.Thread(target=gateway.run, name="kvgate-served", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not gateway.server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    scheme = "https" if settings.tls_enabled else "http"
    try:
        yield f"{scheme}://127.0.0.1:{port}", gateway
    finally:
        gateway.server.should_exit = True
        thread.join(timeout_s)
