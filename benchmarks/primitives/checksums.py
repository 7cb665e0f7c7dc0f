"""Checksums per core: GB/s of one thread's CPU time over 2 MiB buffers, for each candidate that is installed.

    .venv/bin/python -m benchmarks.primitives.checksums [--mib 2] [--runs 5]

hashlib's sha256 and awscrt (a kvgate dependency) always; ``xxhash``, ``crc64fast`` and ``google-crc32c`` when
present (``pip install xxhash crc64fast google-crc32c`` to compare them). Each figure is the median of ``--runs``
runs, with the lowest and highest.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import statistics
import time
from collections.abc import Callable


def candidates(buf: bytes) -> dict[str, Callable[[], object]]:
    from awscrt import checksums

    found: dict[str, Callable[[], object]] = {
        "sha256 (hashlib)": lambda: hashlib.sha256(buf).digest(),
        "crc64nvme (awscrt)": lambda: checksums.crc64nvme(buf),
        "crc32c (awscrt)": lambda: checksums.crc32c(buf),
    }
    try:
        xxhash = importlib.import_module("xxhash")
        found["xxh3-128 (xxhash)"] = lambda: xxhash.xxh3_128(buf).digest()
    except ImportError:
        pass
    try:
        crc64fast = importlib.import_module("crc64fast")

        def fast() -> object:
            h = crc64fast.crc64fast()
            h.update(buf)
            return h.digest()

        found["crc64nvme (crc64fast)"] = fast
    except ImportError:
        pass
    try:
        crc32c = importlib.import_module("google_crc32c")
        found["crc32c (google-crc32c)"] = lambda: crc32c.value(buf)
    except ImportError:
        pass
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    buf = os.urandom(int(args.mib * 1024 * 1024))
    print(f"{'checksum':<26} {'GB/s per core':>24}   (load average {os.getloadavg()[0]:.1f})")
    for name, run in candidates(buf).items():
        n = max(1, int(2e9 / len(buf))) if "sha256" not in name else max(1, int(2e8 / len(buf)))
        rates = []
        for _ in range(args.runs):
            t0 = time.thread_time()
            for _ in range(n):
                run()
            rates.append(len(buf) * n / (time.thread_time() - t0) / 1e9)
        med = statistics.median(rates)
        print(f"{name:<26} {med:>8.2f} ({min(rates):.2f}-{max(rates):.2f})")


if __name__ == "__main__":
    main()
