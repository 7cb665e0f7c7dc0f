"""How long a full cyclic-garbage collection stops the gateway's event loop, with start-up objects frozen and not.

    .venv/bin/python -m benchmarks.gc_pause [--cache-entries 65536] [--repeat 3]

Runs the app's lifespan in this process (memory store, SQLite index in a temp dir; as tests/inprocess/harness.py),
serves a few requests, then times ``gc.collect()`` (best of ``--repeat``): with what the lifespan froze (the
gateway's own state since it freezes at start-up), and with it unfrozen (what a full collection walked before).
Then the same with the metadata cache filled with ``--cache-entries`` entries, the other long-lived population
of a gateway that has served a while. Every request in flight waits for a full collection; they are rare in steady
state and come with bursts of new long-lived objects (a filling cache). CI does not run this.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from pathlib import Path

from app.storage.base import Version
from tests.conftest import key_for
from tests.inprocess.harness import running, settings_for


def full_collection_ms(repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        gc.collect()
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


def timed(label: str, repeat: int, *, frozen: bool) -> float:
    if not frozen:
        gc.unfreeze()
    ms = full_collection_ms(repeat)
    print(f"{label:<44}{len(gc.get_objects()):>10}{ms:>12.1f}")
    gc.freeze()  # as the gateway left it
    return ms


async def run(*, entries: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-gc-") as tmp:
        async with running(settings_for(Path(tmp))) as gw:
            for _ in range(100):
                assert (await gw.client.get("/healthz")).status_code == 200
            print(f"\n{'':<44}{'tracked':>10}{'full gc ms':>12}")
            a = timed("start-up frozen (as served)", repeat, frozen=True)
            b = timed("start-up unfrozen (before)", repeat, frozen=False)
            for i in range(entries):
                gw.core.cache.made(Version(key=key_for(i), size=4096, digest=f"{i:064x}", stamp="0" * 32), epoch=0)
            c = timed(f"+ {entries} cached entries, start-up frozen", repeat, frozen=True)
            d = timed(f"+ {entries} cached entries, unfrozen", repeat, frozen=False)
    print(f"\nfrozen/unfrozen pause: fresh {a / b:.3f}, cache full {c / d:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-entries", type=int, default=65536, help="KVGATE_META_CACHE_ENTRIES' default")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    asyncio.run(run(entries=args.cache_entries, repeat=args.repeat))


if __name__ == "__main__":
    main()
