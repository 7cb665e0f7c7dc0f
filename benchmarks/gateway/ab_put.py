"""PUT throughput of this tree against another revision of kvgate, interleaved in one run: the ratio is the figure.

    .venv/bin/python -m benchmarks.gateway.ab_put --base f081399 [--rounds 3] [--count 200] [-c 16] [--fsync]

The base revision is checked out (``git worktree add --detach``) into a temp dir and served by this venv's python
(its dependencies must be compatible); each round starts a fresh gateway of each tree on an empty data dir and runs
one ``kvgate bench --phases put`` (2 MiB blocks, every key new) against it, then the same for GET. Client and server
share this machine's cores, so only the ratio within the run means much; the server's CPU time per request (from
/proc) is the steadier figure on a noisy machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.gateway.compare import bench
from loopback.gateway import REPO, Gateway


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("--fsync", action="store_true", help="fsync every block (the default of kvgate serve)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgate-ab-") as tmp:
        work = Path(tmp)
        base = work / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=REPO, check=True)
        env = {"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "true" if args.fsync else "false"}
        results: dict[str, dict[str, list[float]]] = {"base": {"put": [], "get": []}, "this": {"put": [], "get": []}}
        cpu: dict[str, dict[str, list[float]]] = {"base": {"put": [], "get": []}, "this": {"put": [], "get": []}}
        try:
            for rnd in range(args.rounds):
                for name, tree in (("base", base), ("this", REPO)):
                    (work / f"{name}-{rnd}").mkdir()
                    gw = Gateway(work / f"{name}-{rnd}" / "data", env=env, repo=tree).start()
                    pids = [gw.proc.pid] if gw.proc else []
                    try:
                        for op in ("put", "get"):
                            out = work / f"{name}-{rnd}-{op}.json"
                            r = bench(
                                gw.url,
                                target="kvgate",
                                concurrency=args.concurrency,
                                phase=op,
                                count=args.count,
                                seed=rnd,
                                out=out,
                                pids=pids,
                            )
                            results[name][op].append(float(r["mb_s"]))
                            cpu[name][op].append(float(r["server_cpu_ms"]))
                    finally:
                        gw.stop()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
    print(f"2 MiB blocks, concurrency {args.concurrency}, fsync {'on' if args.fsync else 'off'}, {args.rounds} rounds")
    for op in ("put", "get"):
        b, t = statistics.median(results["base"][op]), statistics.median(results["this"][op])
        print(f"{op.upper():4} base {args.base}: {b:7.1f} MB/s   this tree: {t:7.1f} MB/s   ratio {t / b:.2f}")
        rounds = {name: [round(x) for x in results[name][op]] for name in results}
        print(f"     rounds base {rounds['base']}  this {rounds['this']}")
        b, t = statistics.median(cpu["base"][op]), statistics.median(cpu["this"][op])
        print(f"     server CPU ms per request: base {b:.2f}  this tree {t:.2f}  ratio {t / b:.2f}")


if __name__ == "__main__":
    main()
