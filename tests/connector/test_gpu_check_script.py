"""scripts/gpu_check.py must keep running: its hazards, driven on CPU tensors (``--dry-run``), check the script's
own bookkeeping (references, load snapshots, hooks). The ordering itself needs a GPU (see the script)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
HAZARDS = ["load-order", "store-overwrite", "finish-early", "buffer-return", "many-steps", "preempt-stall", "layouts"]


def test_dry_run_gives_a_verdict_per_hazard() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--steps", "12", "--trials", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    verdicts = {
        line.split()[0]: line.split()[1]
        for line in run.stdout.splitlines()
        if line.split()[:1] in [[h] for h in HAZARDS]
    }
    assert set(verdicts) == set(HAZARDS), run.stdout
    assert all(v == "PASS" for h, v in verdicts.items() if h != "layouts"), run.stdout
    assert verdicts["layouts"] in ("PASS", "SKIP"), run.stdout


def test_strict_turns_a_skip_into_a_failure() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--strict", "--steps", "1", "--trials", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "SKIP" in run.stdout:
        assert run.returncode == 1 and "FAILED" in run.stdout, run.stdout
