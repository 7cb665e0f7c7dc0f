"""What one write call's size costs the kernel: 2 MiB files written whole in one call, or in calls of 1 MiB, 256
KiB and 64 KiB, system CPU per file, in one run (the order rotates by round).

    .venv/bin/python -m benchmarks.primitives.write_calls [--dir /var/lib/kvgate] [--files 300] [--rounds 2]

Each phase writes ``--files`` new files under ``--dir`` (the filesystem the store would use) after removing the last
phase's and waiting ``--settle`` seconds, so that every phase's page cache grows into memory freed a moment before
(on a VM with free page reporting, memory the host has taken back). Why the filesystem store caps its write calls
(app/storage/fs_files.py, ``WRITE_CALL_BYTES``). ``--keep``: no phase's files are removed, so the page cache grows
through the run, as under a long PUT load (4.8 GB over 2 rounds: one call 3.9x calls of 1 MiB, which climb from
0.8 to 1.5-2.3 ms; an ad-hoc run past 9 GB had every size at 7-9 ms).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

KiB = 1024
MiB = 1024 * KiB
CALLS = (2 * MiB, MiB, 256 * KiB, 64 * KiB)


def write_files(root: Path, *, data: bytes, call: int, files: int) -> float:
    """System CPU milliseconds per file."""
    view = memoryview(data)
    root.mkdir(exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    for i in range(files):
        fd = os.open(root / f"{call}-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off in range(0, len(data), call):
                os.writev(fd, [view[off : off + call]])
        finally:
            os.close(fd)
    return 1000 * (resource.getrusage(resource.RUSAGE_SELF).ru_stime - before) / files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settle", type=float, default=4.0, help="seconds between removing a phase's files and the next")
    ap.add_argument("--keep", action="store_true", help="keep every phase's files (the page cache grows all along)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvgate-write-calls-", dir=args.dir))
    data = os.urandom(2 * MiB)
    got: dict[int, list[float]] = {c: [] for c in CALLS}
    try:
        for rnd in range(args.rounds):
            for call in CALLS[rnd % len(CALLS) :] + CALLS[: rnd % len(CALLS)]:
                if not args.keep:
                    for f in root.iterdir():
                        f.unlink()
                    time.sleep(args.settle)
                got[call].append(write_files(root / f"r{rnd}" if args.keep else root, data=data, call=call,
                                             files=args.files))  # fmt: skip
                print(f"  round {rnd + 1}: calls of {call // KiB:>4} KiB: {got[call][-1]:.2f} ms", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ref = statistics.median(got[MiB])
    print(f"\nsystem CPU per 2 MiB file, ms: median (lowest-highest) of {args.rounds} rounds, {args.files} files each")
    for call in CALLS:
        med = statistics.median(got[call])
        print(f"  calls of {call // KiB:>4} KiB: {med:6.2f} ({min(got[call]):.2f}-{max(got[call]):.2f})"
              f"   {med / ref:5.2f}x calls of 1 MiB")  # fmt: skip


if __name__ == "__main__":
    main()
