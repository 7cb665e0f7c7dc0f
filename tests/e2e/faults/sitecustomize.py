"""Test-only fault points, installed in a kvgate process (gateway, worker, ``kvgate gc``) started with this folder
first on ``PYTHONPATH`` and ``KVGATE_TEST_FAULT=<point>:<flags dir>``. Nothing of it is in the product: it wraps
functions that every release has, so a test shows what an earlier tree did at the same point.

- ``stage-lock``: the first writer's lock taken on a staged file once ``DIR/arm`` exists waits (touches
  ``DIR/held``, waits for ``DIR/go``): a sweep can run in between;
- ``reconcile``: start-up reconcile waits before it begins (touches ``DIR/held``, waits for ``DIR/go``): the
  other workers of a ``--workers N`` gateway serve meanwhile;
- ``removed``: the first block row removal once ``DIR/arm`` exists commits, then the process stops there
  (touches ``DIR/held`` and waits to be killed): a crash right after a row goes.

Crash points (``CRASH_POINTS``): with ``KVGATE_TEST_CRASH=<point>[,<point>...]:<when>`` the process kills itself
(SIGKILL: no cleanup, no answer) right after the named step returned (``all``: every point). ``<when>``: ``N``, the
Nth call of the named steps (1: the first), or ``p<probability>``, each call. With ``KVGATE_TEST_CRASH_DIR=<dir>``
calls count only while ``<dir>/arm`` exists, and only those of the points it names if it names any (one a line);
before it dies the process removes ``arm`` and writes the point's name to ``<dir>/fired``.
Each point wraps a store or index method at its boundary (tests/e2e/test_crash_points.py runs each one).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
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


def _part(args: tuple[Any, ...]) -> bool:
    """The call is about a part's staged file or upload (its key, or its staged version's)."""
    return str(getattr(args[0], "key", args[0])).startswith("_parts/")


def _block(args: tuple[Any, ...]) -> bool:
    return not _part(args)


_FS = "app.storage.filesystem:FilesystemStore"
_INDEX = "app.index.repository:Index"

CRASH_POINTS: dict[str, tuple[str, str, Callable[[tuple[Any, ...]], bool] | None]] = {
    # the versions of a key (app/core/versions.py): PUT, create-only PUT, the PUT of the part that completes
    "staged": (_FS, "stage", _block),  # step 1: the new version written in full, checked, unseen
    "swapped": (_INDEX, "swap_block", None),  # step 2: the key's row names it (also reconcile's record)
    "published": (_FS, "publish", None),  # step 3: renamed over the key's file, the directory fsynced
    "discarded": (_FS, "discard", _block),  # a staged version nobody will commit, dropped
    # removal (DELETE, eviction, purge, repair's drop)
    "row-removed": (_INDEX, "remove_block", None),  # the row gone, the data not yet
    "cleared": (_FS, "clear", None),  # the data gone too (its file and a staged version the row named)
    # parts (app/core/parts.py, in place)
    "part-staged": (_FS, "stage", _part),  # a part's body written to its staged file, checked
    "part-placed": (_FS, "place", None),  # copied into the upload file, not recorded
    "part-recorded": (_INDEX, "add_part", None),  # the part's row committed
    "upload-staged": (_FS, "stage_upload", None),  # the covered upload linked as the object's staged version
    "parts-dropped": (_INDEX, "delete_parts", None),  # the parts' rows gone, the upload file not yet
    # upkeep (app/core/upkeep.py): repair, quarantine; reconcile's roll-forward, adoption, sweep
    "rolled": (_FS, "roll_forward", None),  # a committed version a crash left staged, published
    "quarantined": (_FS, "quarantine", None),  # corrupt bytes moved aside, their row still there
    "claimed": (_FS, "claim", None),  # data without a row hashed and stamped ours, not recorded
    "leftover-dropped": (_FS, "drop_leftover", None),  # a staged file no row names, removed
}
"""point: (module:class, method, which calls count); the process dies right after such a call returned."""


def _crash_points(spec: str, flags: Path | None) -> None:
    import importlib

    names, _, when = spec.rpartition(":")
    chosen = list(CRASH_POINTS) if names == "all" else [n for n in names.split(",") if n]
    unknown = [n for n in chosen if n not in CRASH_POINTS]
    if unknown or not chosen:
        raise SystemExit(f"KVGATE_TEST_CRASH: unknown points {unknown}; known: {', '.join(CRASH_POINTS)}")
    probability = float(when[1:]) if when.startswith("p") else None
    nth = None if probability is not None else int(when)
    calls = [0]

    def due(point: str) -> bool:
        if flags is not None:
            try:
                aimed = (flags / "arm").read_text().split()
            except FileNotFoundError:
                return False
            if aimed and point not in aimed:
                return False
        if probability is not None:
            return random.random() < probability
        calls[0] += 1
        return calls[0] == nth

    def die(point: str) -> None:
        if flags is not None:
            (flags / "arm").unlink(missing_ok=True)
            told = flags / f"fired.{os.getpid()}"
            told.write_text(point)
            told.rename(flags / "fired")  # whole, for whoever reads it
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(point: str, owner: Any, method: str, which: Callable[[tuple[Any, ...]], bool] | None) -> None:
        inner = getattr(owner, method)

        async def crashing(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = await inner(self, *args, **kwargs)
            if (which is None or which(args)) and due(point):
                die(point)
            return out

        setattr(owner, method, crashing)

    for point in chosen:
        where, method, which = CRASH_POINTS[point]
        module, _, cls = where.partition(":")
        wrap(point, getattr(importlib.import_module(module), cls), method, which)


if crash := os.environ.get("KVGATE_TEST_CRASH"):
    flags_dir = os.environ.get("KVGATE_TEST_CRASH_DIR")
    _crash_points(crash, Path(flags_dir) if flags_dir else None)
