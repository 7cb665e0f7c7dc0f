"""Project-venv side of the tier tests: scenarios of tests/vllm/tier_driver.py run in the oracle venv's python.

One driver process serves every scenario of the session (importing vLLM costs tens of seconds on this machine).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
REPLY = "KVGATE-DRIVER "


class TierDriver:
    def __init__(self, python: str) -> None:
        self.log = Path(tempfile.mkstemp(prefix="kvgate-tier-driver-", suffix=".log")[1])
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [python, "-m", "tests.vllm.tier_driver", "serve"],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.lock = threading.Lock()

    def run(self, scenario: str, out: Path, *, timeout_s: float = 240.0, **options: Any) -> dict[str, Any]:
        """Run one scenario; its report.json as a dict (the driver's log is shown on failure)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        request = {"scenario": scenario, "options": {"out": str(out), **{k: _plain(v) for k, v in options.items()}}}
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            timer = threading.Timer(timeout_s, self.proc.kill)
            timer.start()
            try:
                while True:
                    line = self.proc.stdout.readline()
                    if not line:
                        raise AssertionError(f"driver exited {self.proc.poll()}:\n{self.tail()}")
                    if line.startswith(REPLY):
                        reply = json.loads(line[len(REPLY) :])
                        break
            finally:
                timer.cancel()
        assert reply["ok"], f"scenario {scenario} failed:\n{reply.get('error')}\n{self.tail()}"
        report: dict[str, Any] = json.loads((out / "report.json").read_text())
        return report

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


_drivers: dict[str, TierDriver] = {}


def driver(python: str) -> TierDriver:
    """The session's driver for ``python`` (started on first use, closed at exit)."""
    if python not in _drivers:
        _drivers[python] = TierDriver(python)
        atexit.register(_drivers[python].close)
    return _drivers[python]


def run_driver(python: str, scenario: str, out: Path, **options: Any) -> dict[str, Any]:
    return driver(python).run(scenario, out, **options)


def rows(out: Path, *, count: int) -> list[bytes]:
    data = (out / "rows.bin").read_bytes()
    size = len(data) // count
    return [data[i * size : (i + 1) * size] for i in range(count)]


def kvgate_import(
    source: Path, data_dir: Path, env: dict[str, str] | None = None, *, expect_rc: int = 0
) -> dict[str, Any]:
    """Run the real CLI, ``kvgate import SOURCE --data-dir DATA``; its JSON report."""
    proc = subprocess.run(
        [sys.executable, "-m", "app", "import", str(source), "--data-dir", str(data_dir)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "KVGATE_LOG_LEVEL": "warning", **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == expect_rc, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report
