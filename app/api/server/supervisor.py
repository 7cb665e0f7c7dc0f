"""``kvgate serve --workers N``: N gateway processes on one listening socket, kept alive by a small supervisor.

The supervisor binds one listening socket per worker, all on the address with ``SO_REUSEPORT``, so the kernel
spreads new connections over the workers by their addresses' hash. (One socket shared by all does not spread them:
uvloop accepts every waiting connection each time it wakes, so a burst of connections, a connector's pool opening,
lands on one worker.) It keeps the sockets open itself and starts each worker as its own Python process
(``python -m app serve --listen-fd FD``: no ``fork`` of a process with threads or an event loop), which builds the
whole gateway (``create_server``: its own store and index connections, TLS context and reloaders) and serves its
socket. A worker that dies loses the connections it had accepted; the ones waiting on its socket wait for its
replacement, which serves the same socket.

The workers share what the processes of one data directory share (app/core/coordination.py: each key's lock and
the metadata cache's epochs in ``<data_dir>/kvgate.coord``; usage in the index; one evictor at a time), so N
workers keep the guarantees of one process, as ``kvgate gc`` and ``kvgate import`` beside a gateway do; with S3
and PostgreSQL, what replicas share.

- A worker that dies (kill -9, a crash) is replaced; the replacement reconciles at start-up like a restarted gateway
  (only the first worker of the first generation does at start, not all N). One that dies within ``FAST_EXIT_S``
  of its start counts as a failed start: after ``MAX_FAILED_STARTS`` in a row the supervisor stops them all and
  exits 1 (a setting that cannot work would otherwise loop forever).
- SIGTERM / SIGINT: every worker is told (SIGTERM) and finishes its requests; the supervisor waits for them, then
  exits 0 (a worker still running after ``STOP_TIMEOUT_S`` is killed). SIGHUP is passed to every worker (each
  re-reads its TLS files and tokens file). A worker whose supervisor died is told to stop (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType

log = logging.getLogger("kvgate.supervisor")

FAST_EXIT_S = 10.0
"""A worker gone this soon after its start did not start."""
MAX_FAILED_STARTS = 5
STOP_TIMEOUT_S = 60.0
BACKLOG = 2048
"""uvicorn's default listen backlog."""
_PR_SET_PDEATHSIG = 1


def bind_sockets(host: str, port: int, *, count: int) -> list[socket.socket]:
    """``count`` listening sockets on one address (``SO_REUSEPORT``), inheritable (port 0: the first one's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host.strip("[]"), port))
            port = sock.getsockname()[1]
            sock.listen(BACKLOG)
            sock.set_inheritable(True)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def _die_with_parent() -> None:  # pragma: no cover (runs in the child between fork and exec)
    """In the child before exec: SIGTERM when the supervisor dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)


class Supervisor:
    """Starts a worker per socket with ``command(fd)`` and keeps them running (see the module docstring)."""

    def __init__(
        self,
        *,
        socks: list[socket.socket],
        command: Callable[[int], list[str]],
        env: Mapping[str, str],
        first_env: Mapping[str, str] | None = None,
    ) -> None:
        self._socks = socks
        self._command = command
        self._env = dict(env)
        self._first_env = dict(first_env or {})
        """Extra environment of the first generation's workers but the first (e.g. no reconcile at start)."""
        self._workers: dict[int, Worker] = {}
        self._stopping = False
        self._failed_starts = 0

    def _start(self, index: int, *, first: bool) -> None:
        env = {**self._env, **(self._first_env if first and index > 0 else {})}
        fd = self._socks[index].fileno()
        proc = subprocess.Popen(
            self._command(fd),
            env=env,
            pass_fds=(fd,),
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # the supervisor has no threads
        )
        self._workers[proc.pid] = Worker(index=index, proc=proc)
        log.info("worker %d started pid=%d", index, proc.pid)

    def _signal_all(self, signum: int) -> None:
        for worker in self._workers.values():
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signum)

    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        if not self._stopping:
            log.info("stopping %d workers (signal %d)", len(self._workers), signum)
        self._stopping = True
        self._signal_all(signal.SIGTERM)

    def _on_hup(self, _signum: int, _frame: FrameType | None) -> None:
        self._signal_all(signal.SIGHUP)

    def run(self) -> int:
        """Serve until told to stop; the exit status (0 stopped, 1 workers could not be kept running)."""
        previous = {
            sig: signal.signal(sig, handler)
            for sig, handler in (
                (signal.SIGTERM, self._on_stop),
                (signal.SIGINT, self._on_stop),
                (signal.SIGHUP, self._on_hup),
            )
        }
        status = 0
        try:
            for index in range(len(self._socks)):
                self._start(index, first=True)
            status = self._watch()
        finally:
            self._stopping = True
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for sock in self._socks:
                sock.close()
        return status

    def _watch(self) -> int:
        while self._workers:
            try:
                pid, wait_status = os.waitpid(-1, 0)
            except ChildProcessError:
                return 0
            worker = self._workers.pop(pid, None)
            if worker is None:
                continue
            worker.proc.returncode = os.waitstatus_to_exitcode(wait_status)
            if self._stopping:
                continue
            code = worker.proc.returncode
            lived = time.monotonic() - worker.started
            how = f"signal {-code}" if code < 0 else f"status {code}"
            self._failed_starts = self._failed_starts + 1 if lived < FAST_EXIT_S else 0
            if self._failed_starts >= MAX_FAILED_STARTS:
                log.error("worker %d exited with %s %d times in a row at start: stopping", worker.index, how,
                          self._failed_starts)  # fmt: skip
                print(f"kvgate: workers keep exiting at start ({how}): stopping", file=sys.stderr)
                return 1
            print(f"kvgate: worker {worker.index} (pid {pid}) exited with {how}: starting another", file=sys.stderr)
            self._start(worker.index, first=False)
        return 0

    def _stop_all(self) -> None:
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in list(self._workers.values()):
            try:
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
        self._workers.clear()


def worker_socket(fd: int) -> socket.socket:
    """The listening socket a worker was handed by its supervisor."""
    return socket.socket(fileno=fd)
