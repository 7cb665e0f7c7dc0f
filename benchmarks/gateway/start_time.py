"""How long does ``kvgate serve`` take from spawn to a 200 on ``/readyz``, on a new data directory and on a restart?

Spawns ``python -m app serve --port P`` (as the tests' ``Gateway.start()`` does), polls ``/readyz`` every 10 ms and
stops the process once it answers 200: on a fresh empty data directory, then again on that directory (a restart:
an index at head), ``--reps`` times. With ``--base DIR`` the same runs go to another source tree too (another
checkout or worktree), alternated run by run so that load on the machine falls on both alike. Prints the median and
the range in seconds per tree and case, wall time and the gateway's CPU time (user and system, read from /proc
when it is ready: less moved by other load on the machine than the wall time), and the load average at the end.
It does not measure ``--workers`` or PostgreSQL.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loopback.gateway import free_port

REPO = Path(__file__).resolve().parents[2]


def ready(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1.0) as r:
        return bool(r.status == 200)
    return False


def cpu_s(pid: int) -> float:
    """A process's user and system CPU seconds so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_to_ready(tree: Path, data_dir: Path, *, timeout_s: float = 60.0) -> tuple[float, float]:
    """Seconds from spawn to the first 200 on /readyz, and the gateway's CPU seconds by then; it is stopped
    afterwards."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "KVGATE_LOG_LEVEL": "warning", "KVGATE_DATA_DIR": str(data_dir)}
    argv = [sys.executable, "-m", "app", "serve", "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not ready(f"http://127.0.0.1:{port}/readyz"):
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway in {tree} exited with {proc.returncode}")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"the gateway in {tree} not ready after {timeout_s}s")
            time.sleep(0.01)
        return time.perf_counter() - t0, cpu_s(proc.pid)
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--base", type=Path, help="another source tree, measured alongside")
    args = parser.parse_args()
    trees = {"this": REPO} | ({"base": args.base.resolve()} if args.base else {})
    times: dict[tuple[str, str], list[tuple[float, float]]] = {(t, c): [] for t in trees for c in ("fresh", "restart")}
    with tempfile.TemporaryDirectory(prefix="kvgate-start-") as tmp:
        for i in range(args.reps):
            for name, tree in trees.items():
                data_dir = Path(tmp) / f"{name}-{i}"
                times[name, "fresh"].append(start_to_ready(tree, data_dir))
                times[name, "restart"].append(start_to_ready(tree, data_dir))
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for (name, case), runs in times.items():
        for what, ts in (("wall", [w for w, _ in runs]), ("cpu", [c for _, c in runs])):
            median, low, high = statistics.median(ts), min(ts), max(ts)
            print(f"{name:5} {case:8} {what:4} median {median:.3f} s  range {low:.3f}-{high:.3f} s  n={len(ts)}")


if __name__ == "__main__":
    main()
