"""Run alembic's ``upgrade head`` for a URL (the gateway does this at start-up).

The migrations are found through the package: an installed wheel carries them as ``app/migrations`` (the source
tree's ``alembic/`` folder, mapped in setup.py); a checkout used in place has them in ``alembic/`` beside ``app/``.

Processes that start together on one SQLite file (``kvgate serve --workers N`` on a new data directory) migrate one
at a time, under a lock file beside it: SQLite's driver commits each CREATE TABLE by itself, so two processes that
both found no schema both created it, and all but one failed ("table blocks already exists") and were restarted.
PostgreSQL's replicas take an advisory lock in env.py instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import anyio.to_thread
from alembic.config import Config
from sqlalchemy.engine import make_url

import app
from alembic import command


class MigrationsMissing(RuntimeError):
    """Neither the package nor the checkout holds kvgate's alembic scripts (a broken install)."""


def script_location() -> Path:
    """The folder with env.py and versions/: the installed package's, else the checkout's."""
    packaged = resources.files(app) / "migrations"
    candidates = [Path(str(packaged)), Path(app.__file__).resolve().parents[1] / "alembic"]
    for folder in candidates:
        if (folder / "env.py").is_file() and (folder / "versions").is_dir():
            return folder
    raise MigrationsMissing(f"kvgate's migrations are not in {' or '.join(map(str, candidates))}: reinstall kvgate")


def alembic_ini() -> Path:
    """The alembic.ini that ships with the migrations (for ``alembic -c ... upgrade head``)."""
    return script_location() / "alembic.ini"


def alembic_config(url: str) -> Config:
    cfg = Config(str(alembic_ini()))
    cfg.set_main_option("script_location", str(script_location()))
    cfg.attributes["url"] = url
    cfg.attributes["quiet"] = True
    return cfg


async def upgrade_head(url: str) -> None:
    """alembic's env.py runs its own event loop, so it goes to a worker thread."""

    def run() -> None:
        with migration_lock(url):
            command.upgrade(alembic_config(url), "head")

    await anyio.to_thread.run_sync(run)


@contextlib.contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """Hold ``<sqlite file>.migrate.lock`` (an flock: released when its holder ends, kill -9 included) for a SQLite
    file; nothing for other databases. Not a lock on the database file itself: closing any descriptor of that file
    would drop the POSIX locks SQLite holds on it in this process."""
    parsed = make_url(url)
    database = parsed.database
    if not parsed.drivername.startswith("sqlite") or not database or database == ":memory:":
        yield
        return
    fd = os.open(f"{database}.migrate.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
