"""A writer that dies between the index commit naming a new version and that version's publication.

    python -m tests.e2e.crash_writer --root BLOCKS --db INDEX.DB --key KEY --seed N --flags DIR

It stages a version of KEY in the filesystem store (written in full, checked and fsynced, not yet renamed),
touches ``DIR/staged`` and waits for ``DIR/commit``; then it commits the row naming that version, as a PUT's swap
does (here with SQLite directly, so the same writer runs on every release), touches ``DIR/committed`` and waits
to be killed (kill -9): a crash at exactly that point.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

from app.storage.filesystem import FilesystemStore
from tests.conftest import random_bytes

BLOCK = 64 * 1024


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--db", type=Path, required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--flags", type=Path, required=True)
    args = ap.parse_args()
    data = random_bytes(BLOCK, args.seed)

    async def body() -> AsyncIterator[bytes]:
        yield data

    store = FilesystemStore(root=args.root)
    staged = await store.stage(args.key, body(), size=len(data))
    (args.flags / "staged").touch()
    while not (args.flags / "commit").exists():
        await asyncio.sleep(0.02)
    db = sqlite3.connect(args.db, timeout=30)
    with db:
        updated = db.execute(
            "UPDATE blocks SET size = ?, digest = ?, stamp = ?, created_at = ? WHERE key = ?",
            (staged.meta.size, staged.meta.digest, staged.stamp, time.time(), args.key),
        ).rowcount
    assert updated == 1, updated
    (args.flags / "committed").touch()
    while True:
        await asyncio.sleep(1)


if __name__ == "__main__":
    asyncio.run(main())
