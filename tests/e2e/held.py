"""Run a kvgate command (``kvgate gc``, ``kvgate import``) with a hold at one point, so a test can act in between.

    python -m tests.e2e.held --flags DIR --at list|swap -- gc --data-dir ...

- ``list``: the store's listing is held twice: before it starts (the index rows are already read: touches
  ``DIR/before-list``, waits for ``DIR/list``) and after it ends (touches ``DIR/listed``, waits for ``DIR/act``);
- ``swap``: the first row swap the command makes is held (touches ``DIR/held``, waits for ``DIR/act``).

The hooks wrap ``FilesystemStore.list`` and ``Index.swap_block``, which every release has, so the same test runs on
an earlier tree to show what it did there.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any


async def _wait(flag: Path) -> None:
    while not flag.exists():
        await asyncio.sleep(0.02)


def _hold_list(flags: Path) -> None:
    from app.storage.filesystem import FilesystemStore

    listing = FilesystemStore.list

    async def held(self: Any, prefix: str = "") -> AsyncIterator[Any]:
        if prefix:  # a purge's listing, not reconcile's
            async for info in listing(self, prefix):
                yield info
            return
        (flags / "before-list").touch()
        await _wait(flags / "list")
        found = [info async for info in listing(self, prefix)]
        (flags / "listed").touch()
        await _wait(flags / "act")
        for info in found:
            yield info

    FilesystemStore.list = held  # type: ignore[method-assign,assignment]


def _hold_swap(flags: Path) -> None:
    from app.index.repository import Index

    swap = Index.swap_block
    first = [True]

    async def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        if first[0]:
            first[0] = False
            (flags / "held").touch()
            await _wait(flags / "act")
        return await swap(self, *args, **kwargs)

    Index.swap_block = held  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flags", type=Path, required=True)
    ap.add_argument("--at", choices=["list", "swap"], required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    (_hold_list if args.at == "list" else _hold_swap)(args.flags)
    from app.tools.cli import main as cli

    sys.argv = ["kvgate", *[a for a in args.command if a != "--"]]
    cli()


if __name__ == "__main__":
    main()
