"""A real gateway process on a loopback port, for tests and benchmarks: start, wait until ready, kill -9, restart."""

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

import httpx

REPO = Path(__file__).resolve().parents[1]


def listening(pid: int) -> bool:
    """Process ``pid`` has created the server on the listening socket it holds (uvloop registers it with epoll:
    its fdinfo shows an epoll entry for the socket's inode). Approximated here: the process has an epoll instance
    watching a socket in LISTEN state among its descriptors."""
    listen_inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    listen_inodes.add(fields[9])
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    socket_inodes = set()
    epolls = []
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                socket_inodes.add(target[8:-1])
            elif target == "anon_inode:[eventpoll]":
                epolls.append(fd)
    held = socket_inodes & listen_inodes
    if not held:
        return False
    watched = set()
    for fd in epolls:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                if line.startswith("tfd:"):
                    watched.add(line.split()[1])
    numbers = {fd for fd in fds if _inode(pid, fd) in held}
    return bool(numbers & watched)


def _inode(pid: int, fd: str) -> str | None:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return target[8:-1] if target.startswith("socket:[") else None


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


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (a supervisor's workers)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Gateway(LoopbackProcess):
    """``python -m app serve`` in a subprocess with its own data dir and environment; ``workers``: that many
    gateway processes under a supervisor (``kvgate serve --workers``)."""

    name = "gateway"

    def __init__(
        self,
        data_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        repo: Path = REPO,
        workers: int = 1,
    ) -> None:
        super().__init__(port=port, log_path_for=lambda p: data_dir.parent / f"gateway-{p}.log")
        self.data_dir = data_dir
        self.extra_env = dict(env or {})
        self.cwd = repo
        """The source tree it runs (another checkout for before/after benchmarks)."""
        self.workers = workers

    def start(self, *, timeout_s: float = 90.0) -> Gateway:
        env = {**os.environ, "PYTHONPATH": str(self.cwd), "KVGATE_LOG_LEVEL": "warning", **self.extra_env}
        env.setdefault("KVGATE_DATA_DIR", str(self.data_dir))
        argv = [sys.executable, "-m", "app", "serve", "--port", str(self.port)]
        if self.workers > 1:
            argv += ["--workers", str(self.workers)]

        def ready() -> bool:
            if httpx.get(f"{self.url}/readyz", timeout=1.0).status_code != 200:
                return False
            return self.workers == 1 or self.all_workers_ready()

        self._spawn(argv, env=env, ready=ready, timeout_s=timeout_s)
        return self

    def worker_pids(self) -> list[int]:
        """The worker processes (the gateway's own pid when it runs one)."""
        if self.proc is None:
            return []
        return children(self.proc.pid) if self.workers > 1 else [self.proc.pid]

    def all_workers_ready(self) -> bool:
        """Every worker has finished its start-up (each listens on the shared socket only once it is ready, so a
        worker that answers nothing yet has not): each worker's process has the socket in LISTEN state."""
        pids = self.worker_pids()
        return len(pids) == self.workers and all(listening(pid) for pid in pids)

    def kill9(self) -> None:
        """kill -9 of the whole gateway: every worker and the supervisor at once (all stopped first, so that none
        of them acts on another's death)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pids = [self.proc.pid, *self.worker_pids()] if self.workers > 1 else [self.proc.pid]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def worker_cpu(self) -> dict[int, float]:
        """CPU seconds used so far by each worker process (user + system)."""
        ticks = os.sysconf("SC_CLK_TCK")
        out = {}
        for pid in self.worker_pids():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[pid] = (int(fields[11]) + int(fields[12])) / ticks
        return out

    def kill9_worker(self, pid: int) -> None:
        """kill -9 of one worker (its supervisor starts another)."""
        os.kill(pid, signal.SIGKILL)

    def restart(self) -> Gateway:
        self.stop()
        return self.start()
