"""Throughput vs concurrency per system, from the report benchmarks/gateway/compare.py writes (matplotlib, PNG)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(22, 4.2))
    names = list(report["systems"])
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    for ax, (op, title) in zip(axes[:2], [("put", "PUT 2 MiB (MB/s)"), ("get", "GET 2 MiB (MB/s)")], strict=True):
        for name, by_c in report["systems"].items():
            pts = sorted((int(c), s[op]["mb_s"]) for c, s in by_c.items() if op in s)
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=name, color=colors[name])
        ax.set_title(title)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    at16 = {n: d.get("16", {}) for n, d in report["systems"].items()}
    bars = [(n, at16[n]["head"]["req_s"]) for n in names if "head" in at16[n]]
    axes[2].bar([b[0] for b in bars], [b[1] for b in bars], color=[colors[b[0]] for b in bars])
    axes[2].set_title("HEAD at concurrency 16 (req/s)")
    cpu = [
        (f"{n.replace('kvgate-', '').replace('(moto)', '')}\n{op.upper()}", at16[n][op].get("server_cpu_ms", 0.0), n)
        for op in ("put", "get")
        for n in names
        if op in at16[n]
    ]
    axes[3].bar([c[0] for c in cpu], [c[1] for c in cpu], color=[colors[c[2]] for c in cpu])
    axes[3].set_title("server process CPU ms per 2 MiB request (c=16)")
    axes[3].tick_params(axis="x", labelsize=7)
    lookups = [(n, at16[n]["lookup"]) for n in names if "lookup" in at16[n]]
    keys = lookups[0][1].get("keys", 32) if lookups else 32
    axes[4].bar(
        [f"{n}\np50" for n, _ in lookups] + [f"{n}\np99" for n, _ in lookups],
        [lk.get("p50_ms", 0.0) for _, lk in lookups] + [lk.get("p99_ms", 0.0) for _, lk in lookups],
        color=[colors[n] for n, _ in lookups] * 2,
    )
    axes[4].set_title(f"POST /v1/lookup of {keys} keys at c=16 (ms per call)")
    for ax in axes[2:]:
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].legend()
    cpus = report["machine"]["cpus"]
    fig.suptitle(
        f"kvgate vs nginx WebDAV, same disk, one client process (kvgate bench, aiohttp); {cpus} cores shared by "
        f"client and servers; nginx never fsyncs, kvgate-fs neither, kvgate-fs-fsync does (its default);\n"
        "kvgate also sha256s every byte"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks.json")
    print(plot(json.loads(src.read_text()), src.with_name("benchmarks-throughput.png")))
