"""Run alembic's ``upgrade head`` for a URL (the gateway does this at start-up).

The migrations are found through the package: an installed wheel carries them as ``app/migrations`` (the source
tree's ``alembic/`` folder, mapped in setup.py); a checkout used in place has them in ``alembic/`` beside ``app/``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import anyio.to_thread
from alembic.config import Config

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
    await anyio.to_thread.run_sync(command.upgrade, alembic_config(url), "head")
