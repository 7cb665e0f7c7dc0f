"""Async alembic environment: the URL is kvgate's (Settings), or the one the gateway passes in."""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic.util import CommandError
from sqlalchemy import Connection, pool, text
from sqlalchemy.ext.asyncio import create_async_engine

from alembic import context
from app.config import Settings
from app.index.models import Base
from app.settings_help import error_lines, is_settings_error

config = context.config
if config.config_file_name is not None and not config.attributes.get("quiet"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata
MIGRATION_LOCK = 0x6B76_6761_7465  # "kvgate": PostgreSQL advisory lock key serializing migrations


def _url() -> str:
    url = config.attributes.get("url")
    if url:
        return str(url)
    try:
        settings = Settings()
    except Exception as exc:
        if not is_settings_error(exc):
            raise
        raise CommandError("; ".join(error_lines(exc))) from None  # type: ignore[arg-type]  # alembic: "FAILED: ..."
    if settings.db_url is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)  # the SQLite index lives there, as under kvgate serve
    return settings.resolved_db_url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # replicas starting together: one migrates, the others wait here and then find the schema at head
            connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
        context.run_migrations()


async def _run_async() -> None:
    engine = create_async_engine(_url(), poolclass=pool.NullPool)
    async with engine.connect() as connection:
        await connection.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async())
