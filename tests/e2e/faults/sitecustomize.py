"""Test-only fault points, installed in a kvgate process (gateway, worker, ``kvgate gc``) started with this folder
first on ``PYTHONPATH`` and ``KVGATE_TEST_FAULT=<point>:<flags dir>``. Nothing of it is in the product: it wraps
functions that every release has, so a test shows what an earlier tree did at the same point.

- ``stage-lock``: the first writer's lock taken on a staged file once ``DIR/arm`` exists waits (touches
  ``DIR/held``, waits for ``DIR/go``): a sweep can run in between;
- ``reconcile``: start-up reconcile waits before it begins (touches ``DIR/held``, waits for ``DIR/go``): the
  other workers of a ``--workers N`` gateway serve meanwhile;
- ``removed``: the first block row removal once ``DIR/arm`` exists commits, then the process stops there
  (touches ``DIR/held`` and waits to be killed): a crash right after a row goes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def _wait(flag: Path) -> None:
    while not flag.exists():
        time.sleep(0.01)


def _stage_lock(flags: Path) -> None:
    from app.storage import fs_files

    lock = fs_files.lock_file
    first = [True]

    def held(fd: int, *, wait: bool = False) -> bool:
        if first[0] and (flags / "arm").exists():
            first[0] = False
            (flags / "held").touch()
            _wait(flags / "go")
        return lock(fd, wait=wait)

    fs_files.lock_file = held


def _removed(flags: Path) -> None:
    import asyncio

    from app.index.repository import Index

    remove = Index.remove_block
    first = [True]

    async def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        old = await remove(self, *args, **kwargs)
        if old is not None and first[0] and (flags / "arm").exists():
            first[0] = False
            (flags / "held").touch()
            while True:
                await asyncio.sleep(1)
        return old

    Index.remove_block = held  # type: ignore[method-assign]


def _reconcile(flags: Path) -> None:
    import asyncio

    from app.core import reconcile as module

    run = module.reconcile

    async def held(**kwargs: Any) -> Any:
        (flags / "held").touch()
        while not (flags / "go").exists():
            await asyncio.sleep(0.02)
        return await run(**kwargs)

    module.reconcile = held  # type: ignore[assignment]


_POINTS = {"stage-lock": _stage_lock, "removed": _removed, "reconcile": _reconcile}

if spec := os.environ.get("KVGATE_TEST_FAULT"):
    point, _, where = spec.partition(":")
    _POINTS[point](Path(where))
