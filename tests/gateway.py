"""A real gateway process on a loopback port, for tests: start, wait until ready, kill -9, restart."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def settled_stats(c: httpx.Client, *, timeout_s: float = 20.0) -> dict[str, Any]:
    """/v1/stats once background eviction has finished: usage is under the high mark and no round is in flight
    (a round goes on to the low mark, batch by batch, after usage passes the high one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats: dict[str, Any] = c.get("/v1/stats").json()
        bound = stats["max_bytes"]
        under = bound is None or stats["usage_bytes"] <= bound * stats["high_watermark"]
        if (under and not stats["evicting"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackProcess:
    """A server subprocess on a loopback port: spawned with its output in a log file, polled until it answers."""

    name = "server"

    def __init__(self, *, port: int | None, log_path_for: Callable[[int], Path]) -> None:
        self.port = port or free_port()
        self.log_path = log_path_for(self.port)
        self.proc: subprocess.Popen[bytes] | None = None
        self.cwd = REPO

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _spawn(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str],
        ready: Callable[[], bool],
        timeout_s: float,
        cwd: Path | None = None,
    ) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, cwd=cwd or self.cwd, env=dict(env), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if ready():
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s}s:\n{self.log()}")

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()


class Gateway(LoopbackProcess):
    """``python -m app serve`` in a subprocess with its own data dir and environment."""

    name = "gateway"

    def __init__(
        self, data_dir: Path, *, env: Mapping[str, str] | None = None, port: int | None = None, repo: Path = REPO
    ) -> None:
        super().__init__(port=port, log_path_for=lambda p: data_dir.parent / f"gateway-{p}.log")
        self.data_dir = data_dir
        self.extra_env = dict(env or {})
        self.cwd = repo
        """The source tree it runs (another checkout for before/after benchmarks)."""

    def start(self, *, timeout_s: float = 90.0) -> Gateway:
        env = {**os.environ, "PYTHONPATH": str(self.cwd), "KVGATE_LOG_LEVEL": "warning", **self.extra_env}
        env.setdefault("KVGATE_DATA_DIR", str(self.data_dir))
        self._spawn(
            [sys.executable, "-m", "app", "serve", "--port", str(self.port)],
            env=env,
            ready=lambda: httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200,
            timeout_s=timeout_s,
        )
        return self

    def restart(self) -> Gateway:
        self.stop()
        return self.start()
