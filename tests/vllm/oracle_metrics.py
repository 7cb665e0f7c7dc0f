"""Run in the oracle venv: KVGateConnector's Prometheus metrics, built the way vLLM builds them, fed two stats dicts
made by a real ``SchedulerPlanner.report()``.

vLLM's own ``KVConnectorProm`` (what its ``PrometheusStatLogger`` holds) finds the connector class through the
factory and calls its ``build_prom_metrics`` with prometheus_client's classes; its ``observe`` then gets what the
scheduler sends, ``KVGateStats.to_dict()``. The planner decides for real (connector/cost.py) over a client that
answers lookups at once (no gateway: only its decisions and their counts matter here).

argv: none; prints ``RESULT`` and one JSON object: the reports, what ``build_prom_metrics`` returned, and the
``generate_latest()`` text.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Sequence
from typing import Any

import prometheus_client
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

from connector.cost import MIB, CostModel, CostSettings, LoadOutcome
from connector.plan import KeyScheme, SchedulerPlanner
from connector.vllm import KVGateStats
from contract.keys import KVGroup, naming

BLOCK = 16
LABELNAMES = ["model_name", "engine"]  # as vLLM's PrometheusStatLogger names them
ENGINES: dict[int, list[object]] = {0: ["tiny", "0"], 1: ["tiny", "1"]}
UNKNOWN = {"stores_dropped_someday": 3, "histogram_someday": [1, 2], "note_someday": "text"}


class InstantClient:
    """Every key is present and answered at once; ``stall``: the next lookups never answer."""

    def __init__(self) -> None:
        self.stall = False

    def lookup(self, keys: Sequence[str], *, wait_s: float = 0.0, min_prefix: int | None = None) -> int | None:
        return None if self.stall else len(keys)

    def submit(self, answer: int | None) -> concurrent.futures.Future[tuple[int, list[Any]]]:
        future: concurrent.futures.Future[tuple[int, list[Any]]] = concurrent.futures.Future()
        if answer is not None:
            future.set_result((answer, []))
        return future


def hit(planner: SchedulerPlanner, req_id: str, blocks: int) -> int | None:
    """A request whose first ``blocks`` blocks the gateway holds (plus one token vLLM must compute)."""
    hashes = [f"{req_id}-{i}".encode() for i in range(blocks)]
    return planner.matched_tokens(
        req_id=req_id, block_hashes=hashes, num_tokens=blocks * BLOCK + 1, num_computed_tokens=0
    )


def reports() -> list[dict[str, float]]:
    run = naming(
        model_name="test-org/tiny",
        tokens_per_hash=BLOCK,
        tp_size=1,
        rank=0,
        dtype="bfloat16",
        groups=[KVGroup(tokens_per_block=BLOCK, layer_names=["l0"], mla=False)],
        num_kv_heads=8,
        total_kv_heads=8,
    )
    client = InstantClient()
    # a block loads in 1 s at the prior bandwidth and recomputes in 0.5 s
    cost = CostModel(CostSettings(bandwidth_prior_bytes_s=1.0 * MIB, prefill_tokens_s=2.0 * BLOCK))
    planner = SchedulerPlanner(
        client=client,  # type: ignore[arg-type]  # what the planner uses of a BlockClient
        keys=KeyScheme(namings=[run], num_groups=1),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        cost=cost,
        block_bytes=MIB,
        lookup_deadline_s=0.0,
    )
    out = []
    # 1: no load measured the link yet, recompute is faster: a probe; it runs out of its deadline (abandoned) and
    # measures 0.5 MiB/s, so the next hit is skipped
    assert hit(planner, "probe", 4) == 4 * BLOCK
    planner.loaded(req_id="probe", outcome=LoadOutcome(loaded=1, nbytes=MIB // 2, seconds=1.0, expired=True))
    assert hit(planner, "skip", 4) == 0
    out.append(planner.report())
    # 2: a fast load lifts the estimate: a short hit loads whole, a long one only what fits the longest wait; one
    # lookup never answers
    planner.loaded(req_id="warm", outcome=LoadOutcome(loaded=4, nbytes=1000 * MIB, seconds=1.0, expired=False))
    assert hit(planner, "load", 2) == 2 * BLOCK
    partial = hit(planner, "partial", 2000)
    assert partial is not None and 0 < partial < 2000 * BLOCK, partial
    planner.loaded(req_id="load", outcome=LoadOutcome(loaded=2, nbytes=2 * MIB, seconds=0.02, expired=False))
    client.stall = True
    assert hit(planner, "stalled", 2) == 0
    out.append(planner.report())
    return out


def main() -> None:
    r1, r2 = reports()
    kt = KVTransferConfig(
        kv_connector="KVGateConnector",
        kv_connector_module_path="connector.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"url": "http://127.0.0.1:1"},
    )
    prom = KVConnectorProm(
        VllmConfig(kv_transfer_config=kt, device_config=DeviceConfig(device="cpu")), LABELNAMES, ENGINES
    )
    # what the scheduler sends vLLM's loggers: the stats object's dict
    prom.observe(KVGateStats(data=dict(r1)).to_dict(), 0)
    prom.observe(KVGateStats(data={**r2, **UNKNOWN}).to_dict(), 0)
    prom.observe(dict(r2), 7)  # an engine it was not built for: ignored
    built = prom.prom_metrics
    text = prometheus_client.generate_latest().decode()
    print(
        "RESULT "
        + json.dumps({"built": None if built is None else type(built).__name__, "reports": [r1, r2], "text": text})
    )


if __name__ == "__main__":
    main()
