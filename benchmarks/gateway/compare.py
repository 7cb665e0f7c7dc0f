"""kvgate next to nginx (WebDAV) on the same machine, same disk, same client, one run: ratios per op.

    .venv/bin/python -m benchmarks.gateway.compare [--quick] [--out docs]

Needs Debian's nginx (``apt-get install -y nginx``: its binary has the dav module built in); CI does not run this.
Starts nginx (one worker, no daemon, its own temp config/root/pid/logs) and kvgate on the filesystem backend
(``python -m app serve``) with block fsync off (nginx never fsyncs) and, for PUT only, with it on (the default: what a
durable PUT costs), optionally kvgate on S3 against moto's server, then runs ``kvgate bench`` (one client
process) against each for 2 MiB PUT/GET at concurrency 1, 16, 64 and HEAD, and prints kvgate/nginx ratios.
Client and servers share this machine's cores: the figures say how many there were.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loopback.gateway import REPO, Gateway, free_port
from loopback.s3_servers import MotoServer

MiB = 1024 * 1024
BLOCK = 2 * MiB


class Nginx:
    """nginx in the foreground with a WebDAV root under ``work``; PUT/DELETE allowed, full paths created."""

    def __init__(self, work: Path, *, workers: int = 1) -> None:
        self.work = work
        self.port = free_port()
        self.workers = workers
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Nginx:
        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(exe).exists():
            raise RuntimeError("nginx not found: apt-get install -y nginx")
        root = self.work / "root"
        root.mkdir(parents=True)
        for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.work / d).mkdir()
        user = "user root;" if os.geteuid() == 0 else ""
        conf = self.work / "nginx.conf"
        conf.write_text(
            f"""{user}
daemon off;
worker_processes {self.workers};
pid {self.work}/nginx.pid;
error_log {self.work}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    keepalive_timeout 60;
    client_max_body_size 1g;
    client_body_temp_path {self.work}/body;
    proxy_temp_path {self.work}/proxy;
    fastcgi_temp_path {self.work}/fastcgi;
    uwsgi_temp_path {self.work}/uwsgi;
    scgi_temp_path {self.work}/scgi;
    server {{
        listen 127.0.0.1:{self.port};
        root {root};
        location / {{
            dav_methods PUT DELETE;
            create_full_put_path on;
            dav_access user:rw group:r all:r;
        }}
    }}
}}
"""
        )
        self.proc = subprocess.Popen([exe, "-c", str(conf), "-p", str(self.work)], stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.work / 'error.log').read_text(errors='replace')}")
            try:
                httpx.get(self.url, timeout=1.0)
                return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("nginx did not come up")

    def pids(self) -> list[int]:
        """The master and its workers (for CPU accounting)."""
        if self.proc is None:
            raise RuntimeError("nginx is not running")
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return [self.proc.pid, *map(int, kids)]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def gateway_pids(gw: Gateway) -> list[int]:
    if gw.proc is None:
        raise RuntimeError("gateway is not running")
    return [gw.proc.pid]


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime (clock ticks) of these processes, all their threads included."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


def bench(
    url: str, *, target: str, concurrency: int, phase: str, count: int, seed: int, out: Path, pids: list[int]
) -> dict[str, Any]:
    """One ``kvgate bench`` process for one phase; returns its stats plus the server's CPU ms per request."""
    op = phase.partition(":")[0]
    cmd = [
        sys.executable, "-m", "app", "bench", "--quiet", "--url", url, "--target", target,
        "-c", str(concurrency), "-n", str(count), "--block-size", str(BLOCK), "--phases", phase,
        "--seed", str(seed), "--json", str(out),
    ]  # fmt: skip
    before = cpu_ticks(pids)
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=300)
    used = cpu_ticks(pids) - before
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench failed ({proc.returncode}): {proc.stderr.decode()[-2000:]} {result.get('first_errors')}"
        )
    stats: dict[str, Any] = result["phases"][0]["ops"][op]
    if stats["misses"]:  # every key was PUT in the phase before: a 404 here is a server bug
        raise RuntimeError(f"{target} {op}: {stats['misses']} misses for keys that were stored")
    stats["server_cpu_ms"] = 1000 * used / os.sysconf("SC_CLK_TCK") / max(1, stats["requests"])
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="alternate the systems this many times; keep each best")
    ap.add_argument("--out", type=Path, default=REPO / "docs", help="results JSON + plot go here")
    args = ap.parse_args()
    scale = 0.25 if args.quick else 1.0
    n_blocks = {1: 48, 16: 160, 64: 256}
    n_head = int(4000 * scale)
    work = Path(tempfile.mkdtemp(prefix="kvgate-compare-"))
    systems: dict[str, dict[int, dict[str, Any]]] = {}
    notes: list[str] = []
    started: list[Any] = []
    try:
        nginx = Nginx(work / "nginx").start()
        started.append(nginx)
        fs_env = {"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "false"}
        for d in ("kvgate", "kvgate-fsync", "kvgate-s3"):
            (work / d).mkdir()
        gw = Gateway(work / "kvgate" / "data", env=fs_env).start()
        started.append(gw)
        # the default: each block file and its directory fsynced before the PUT answers (nginx has no such mode)
        gw_durable = Gateway(work / "kvgate-fsync" / "data", env={**fs_env, "KVGATE_BACKEND__FSYNC": "true"}).start()
        started.append(gw_durable)
        targets: list[tuple[str, str, str, list[int]]] = [
            ("nginx", nginx.url, "webdav", nginx.pids()),
            ("kvgate-fs", gw.url, "kvgate", gateway_pids(gw)),
            ("kvgate-fs-fsync", gw_durable.url, "kvgate", gateway_pids(gw_durable)),
        ]
        if not args.no_s3:
            try:
                moto = MotoServer(log_dir=work).start()
                started.append(moto)
                s3_env = moto.backend_env(bucket="kvgate-bench")
                gws3 = Gateway(work / "kvgate-s3" / "data", env=s3_env).start()
                started.append(gws3)
                targets.append(("kvgate-s3(moto)", gws3.url, "kvgate", gateway_pids(gws3)))
            except RuntimeError as exc:
                notes.append(f"kvgate on S3 skipped: {str(exc)[:300]}")
        for c in args.concurrency:
            n = max(8, int(n_blocks.get(c, 128) * scale))
            for r in range(args.rounds):
                for name, url, target, pids in targets:
                    n_run = n // 2 if name.startswith("kvgate-s3") else n  # moto keeps objects in its own memory
                    phases = ["put", "get"] + ([f"head:{n_head}"] if c == 16 else [])
                    if name == "kvgate-fs-fsync":
                        phases = ["put"]  # what a durable PUT costs; its reads are kvgate-fs's
                    elif target == "kvgate" and c == 16:
                        phases.append(f"lookup:{int(1000 * scale)}")
                    print(f"  round {r + 1} {name:>16} c={c:<3} {','.join(phases)} ...", flush=True)
                    best = systems.setdefault(name, {}).setdefault(c, {})
                    for phase in phases:
                        op = phase.partition(":")[0]
                        out = work / f"{name}-{c}-{r}-{op}.json"
                        stats = bench(
                            url, target=target, concurrency=c, phase=phase, count=n_run, seed=100 * r + c, out=out,
                            pids=pids,
                        )  # fmt: skip
                        unit = "req_s" if op in ("head", "lookup") else "mb_s"
                        if op not in best or stats[unit] > best[op][unit]:
                            best[op] = stats
        pipeline = connector_pipeline(notes)
    finally:
        for s in reversed(started):
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "block_bytes": BLOCK,
        "systems": {k: {str(c): v for c, v in d.items()} for k, d in systems.items()},
        "connector_pipeline": pipeline,
        "notes": notes,
        "rounds": args.rounds,
        "command": " ".join(["python -m benchmarks.gateway.compare", *sys.argv[1:]]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmarks.json").write_text(json.dumps(report, indent=2))
    print_report(report)
    from benchmarks.plot import plot

    png = plot(report, args.out / "benchmarks-throughput.png")
    print(f"\nresults: {args.out / 'benchmarks.json'}  plot: {png}")


def connector_pipeline(notes: list[str]) -> dict[str, Any] | None:
    script = REPO / "benchmarks" / "connector" / "pipeline.py"
    if not script.exists():
        notes.append("connector pipeline row left empty: benchmarks/connector/pipeline.py not present yet")
        return None
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.connector.pipeline", "--blocks", "48"],  # starts its own gateway
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    if proc.returncode != 0:
        notes.append(f"connector pipeline failed ({proc.returncode}): {proc.stderr[-500:]}")
        return None
    return {"output": proc.stdout[-3000:]}


def print_report(report: dict[str, Any]) -> None:
    sys_ = report["systems"]
    base = sys_.get("nginx", {})
    names = [n for n in sys_ if n != "nginx"]
    print(
        f"\n2 MiB blocks, one client process; {report['machine']['cpus']} cores shared by client and server; "
        f"best of {report['rounds']} alternating rounds. cpu = server CPU ms per request"
    )
    print(f"{'op':<5}{'conc':>5}{'nginx':>10}{'cpu':>7}" + "".join(f"{n:>17}{'cpu':>7}{'ratio':>7}" for n in names))
    rows = [(op, c) for c in sorted(int(c) for c in base) for op in ("put", "get", "head") if op in base[str(c)]]
    for op, c in rows:
        unit, suffix = ("req_s", "/s") if op == "head" else ("mb_s", "MB/s")
        ref = base[str(c)][op]
        line = f"{op:<5}{c:>5}{ref[unit]:>6.0f}{suffix:<4}{ref.get('server_cpu_ms', 0):>7.2f}"
        for n in names:
            s = sys_[n].get(str(c), {}).get(op)
            if s is None:
                line += f"{'-':>17}{'-':>7}{'-':>7}"
            else:
                line += f"{s[unit]:>13.0f}{suffix:<4}{s.get('server_cpu_ms', 0):>7.2f}{s[unit] / ref[unit]:>7.2f}"
        print(line)
    for n in names:
        lk = sys_[n].get("16", {}).get("lookup")
        if lk:
            print(f"lookup (32 keys) c=16 {n}: {lk['req_s']:.0f}/s p50 {lk['p50_ms']:.2f} ms")
    for note in report["notes"]:
        print(f"note: {note}")
    if report.get("connector_pipeline"):
        print("connector pipeline:\n" + report["connector_pipeline"]["output"])


if __name__ == "__main__":
    main()
