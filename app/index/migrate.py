"""Run alembic's ``upgrade head`` for a URL (the gateway does this at start-up)."""

from __future__ import annotations

from pathlib import Path

import anyio.to_thread
from alembic.config import Config

from alembic import command

ROOT = Path(__file__).resolve().parents[2]


def alembic_config(url: str) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "alembic"))
    cfg.attributes["url"] = url
    cfg.attributes["quiet"] = True
    return cfg


async def upgrade_head(url: str) -> None:
    """alembic's env.py runs its own event loop, so it goes to a worker thread."""
    await anyio.to_thread.run_sync(command.upgrade, alembic_config(url), "head")
