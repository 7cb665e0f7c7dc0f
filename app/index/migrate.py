"""Run alembic's ``upgrade head`` for a URL (the gateway does this at start-up).

The migrations are found through the package: an installed wheel carries them as ``app/migrations`` (the source
tree's ``alembic/`` folder, mapped in setup.py); a checkout used in place has them in ``alembic/`` beside ``app/``.

Processes that start together on one SQLite file (``kvgate serve --workers N`` on a new data directory) migrate one
at a time, under a lock file beside it: SQLite's driver commits each CREATE TABLE by itself, so two processes that
both found no schema both created it, and all but one failed ("table blocks already exists") and were restarted.
PostgreSQL's replicas take an advisory lock in env.py instead.

A SQLite file already at head (every start but the first) is found so from its ``alembic_version`` and the scripts'
revisions read as text, and alembic is not imported at all: importing it is most of what a migration costs.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import anyio.to_thread
from sqlalchemy.engine import make_url

import app

if TYPE_CHECKING:
    from alembic.config import Config


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
    from alembic.config import Config

    cfg = Config(str(alembic_ini()))
    cfg.set_main_option("script_location", str(script_location()))
    cfg.attributes["url"] = url
    cfg.attributes["quiet"] = True
    return cfg


async def upgrade_head(url: str) -> None:
    """alembic's env.py runs its own event loop, so it goes to a worker thread."""

    def run() -> None:
        if sqlite_at_head(url):
            return
        from alembic import command

        with migration_lock(url):
            command.upgrade(alembic_config(url), "head")

    await anyio.to_thread.run_sync(run)


def head_revisions(folder: Path) -> set[str]:
    """The revisions no script names as its ``down_revision``, read from the scripts' text (not imported)."""
    revisions: set[str] = set()
    downs: set[str] = set()
    for script in (folder / "versions").glob("*.py"):
        for node in ast.parse(script.read_text()).body:
            targets: list[ast.expr]
            if isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            elif isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Name) and target.id in ("revision", "down_revision"):
                    found = ast.literal_eval(value)  # a string, None, or a tuple of strings (a merge)
                    names = {found} if isinstance(found, str) else set(found or ())
                    (revisions if target.id == "revision" else downs).update(names)
    return revisions - downs


def sqlite_file(url: str) -> str | None:
    """The file of a SQLite URL; None for other databases and for SQLite in memory."""
    parsed = make_url(url)
    database = parsed.database
    if not parsed.drivername.startswith("sqlite") or not database or database == ":memory:":
        return None
    return database


def sqlite_at_head(url: str) -> bool:
    """True when ``url`` is a SQLite file that exists and whose ``alembic_version`` holds exactly the scripts' one
    head; False when anything is otherwise or cannot be read (then alembic runs, and decides)."""
    database = sqlite_file(url)
    if database is None or not os.path.isfile(database):
        return False  # a new index: alembic creates it (a connection here would create an empty file)
    heads = head_revisions(script_location())
    try:  # through SQLite's own driver, which keeps the locks its other connections in this process hold
        with contextlib.closing(sqlite3.connect(database, timeout=0)) as conn:
            found = {row[0] for row in conn.execute("SELECT version_num FROM alembic_version")}
    except sqlite3.Error:
        return False
    return len(heads) == 1 and found == heads


@contextlib.contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """Hold ``<sqlite file>.migrate.lock`` (an flock: released when its holder ends, kill -9 included) for a SQLite
    file; nothing for other databases. Not a lock on the database file itself: closing any descriptor of that file
    would drop the POSIX locks SQLite holds on it in this process."""
    database = sqlite_file(url)
    if database is None:
        yield
        return
    fd = os.open(f"{database}.migrate.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
