"""KVGateConnector's Prometheus metrics under the real vLLM 0.33.0 (tests/vllm/oracle_metrics.py, in the oracle venv):
vLLM's ``KVConnectorProm`` builds them through ``build_prom_metrics`` and observes two steps' stats: a real
planner's report each, merged with what two worker-role connectors (TP ranks 0 and 1, one with its gateway down,
one with a real gateway) reported through vLLM's ``KVOutputAggregator``. The ``generate_latest()`` text holds each
count's sum, each estimate's latest value, the sum of each rank's newest bytes held, and nothing else.

The names below are what dashboards query (docs/connector-metrics.md): renaming one breaks them, so it fails here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from connector.planning.cost import Verdict
from connector.planning.plan import PlanStats
from connector.worker.pipeline import WORKER_COUNTERS, WORKER_GAUGES
from tests.gateway import Gateway
from tests.vllm.test_interop import TINY_LLAMA, oracle, result

pytestmark = pytest.mark.vllm

DECISIONS = {"loads": "load", "partial": "partial", "skipped": "skip", "probes": "probe", "abandoned": "abandoned"}
"""Report key -> ``verdict`` of vllm:kvgate_decisions_total."""
COUNTERS = {
    "abandoned_lookups": "vllm:kvgate_abandoned_lookups_total",
    "prefetches": "vllm:kvgate_prefetches_planned_total",
    "predicted_load_s": "vllm:kvgate_predicted_load_seconds_total",
    "actual_load_s": "vllm:kvgate_load_seconds_total",
}
GAUGES = {"bandwidth_mib_s": "vllm:kvgate_bandwidth_mib_s", "prefill_tokens_s": "vllm:kvgate_prefill_tokens_s"}
STORE_DROPS = {
    "store_drops_budget": "budget",
    "store_drops_buffer": "buffer",
    "store_drops_full": "gateway_full",
    "store_drops_failed": "failed",
}
"""Worker report key -> ``reason`` of vllm:kvgate_stores_dropped_total."""
WORKER = {
    "stored_blocks": "vllm:kvgate_stored_blocks_total",
    "stored_bytes": "vllm:kvgate_stored_bytes_total",
    "loaded_blocks": "vllm:kvgate_loaded_blocks_total",
    "loaded_bytes": "vllm:kvgate_loaded_bytes_total",
    "dropped_store_requests": "vllm:kvgate_store_requests_dropped_total",
    "dropped_handoff_blocks": "vllm:kvgate_handoff_blocks_dropped_total",
    "handoff_store_waits": "vllm:kvgate_handoff_store_waits_total",
    "expired_loads": "vllm:kvgate_worker_expired_loads_total",
    "load_failed_blocks": "vllm:kvgate_load_failed_blocks_total",
    "corrupt_reads": "vllm:kvgate_corrupt_reads_total",
    "prefetch_started": "vllm:kvgate_prefetches_started_total",
    "prefetch_blocks": "vllm:kvgate_prefetched_blocks_total",
    "prefetch_used": "vllm:kvgate_prefetches_used_total",
    "prefetch_dropped": "vllm:kvgate_prefetches_dropped_total",
    "prefetch_hits": "vllm:kvgate_prefetch_hits_total",
    "prefetch_overflows": "vllm:kvgate_prefetch_overflows_total",
}
HELD = {
    "store_bytes_held": "vllm:kvgate_store_host_bytes_held",
    "load_bytes_held": "vllm:kvgate_load_host_bytes_held",
    "prefetch_bytes_held": "vllm:kvgate_prefetch_host_bytes_held",
}
ENGINES = ("0", "1")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def kvgate_samples(text: str) -> Samples:
    """The exposition's ``vllm:kvgate_*`` samples (no ``_created``): (name, labels) -> value."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:kvgate_") and not s.name.endswith("_created"):
                out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def labels(engine: str, **more: str) -> frozenset[tuple[str, str]]:
    return frozenset({"model_name": "tiny", "engine": engine, **more}.items())


def test_the_mapping_covers_every_report_key_and_verdict() -> None:
    assert set(DECISIONS) | set(COUNTERS) == set(PlanStats.COUNTERS)
    assert set(DECISIONS.values()) == {v.value for v in Verdict} | {"abandoned"}
    assert set(STORE_DROPS) | set(WORKER) == set(WORKER_COUNTERS)
    assert set(HELD) == set(WORKER_GAUGES)
    # the two roles' keys never collide: a worker's count is never summed into a scheduler's
    assert not (set(WORKER_COUNTERS) | set(WORKER_GAUGES)) & (set(PlanStats.COUNTERS) | set(GAUGES))


@pytest.fixture(scope="module")
def got(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model = tmp_path_factory.mktemp("tiny-llama")
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    gw = Gateway(tmp_path_factory.mktemp("gw") / "data").start()
    try:
        yield result(oracle(vllm_python, "oracle_metrics.py", gw.url, str(model)))
    finally:
        gw.stop()


def want_samples(got: dict[str, Any], steps: list[dict[str, Any]]) -> Samples:
    """What the exposition must hold after ``steps`` were observed on engine 0 (engine 1 saw none)."""
    r2 = got["reports"][1]
    want: Samples = {}
    for engine in ENGINES:
        observed = steps if engine == "0" else []
        for key, verdict in DECISIONS.items():
            total = sum(r.get(key, 0) for r in observed)
            want[("vllm:kvgate_decisions_total", labels(engine, verdict=verdict))] = total
        for key, reason in STORE_DROPS.items():
            total = sum(r.get(key, 0) for r in observed)
            want[("vllm:kvgate_stores_dropped_total", labels(engine, reason=reason))] = total
        for key, name in (COUNTERS | WORKER).items():
            want[(name, labels(engine))] = sum(r.get(key, 0) for r in observed)
        for key, name in GAUGES.items():
            if observed:  # an engine's estimates appear with its first report
                want[(name, labels(engine))] = r2[key]
        for key, name in HELD.items():  # each rank's newest, summed; 0 before any
            newest: dict[str, int] = {}
            for r in observed:
                newest.update(r.get(key, {}))
            want[(name, labels(engine))] = sum(newest.values())
    return want


def test_build_prom_metrics_registers_the_connectors_metrics(got: dict[str, Any]) -> None:
    assert got["built"] == "KVGatePromMetrics"


def test_counters_hold_the_sums_and_gauges_the_latest(got: dict[str, Any]) -> None:
    r1, r2 = got["reports"]
    p1, p2, _ = got["steps"]
    # the scenario made every key of the report: every metric below is checked against a count it saw
    assert set(r1) | set(r2) == set(PlanStats.COUNTERS) | set(GAUGES), (r1, r2)
    assert r2["bandwidth_mib_s"] != r1["bandwidth_mib_s"]
    # each step's dict is the scheduler's report merged with the workers' (no key of one role in the other's)
    assert {k: p1[k] for k in r1} == r1 and {k: p2[k] for k in r2} == r2
    samples = kvgate_samples(got["text"])
    want = want_samples(got, [p1, p2])
    assert set(samples) == set(want), sorted(set(samples) ^ set(want))
    for k, value in want.items():
        assert samples[k] == pytest.approx(value, rel=1e-9), k
    # what the scenario decided, once each
    for verdict in ("load", "partial", "skip", "probe", "abandoned"):
        assert samples[("vllm:kvgate_decisions_total", labels("0", verdict=verdict))] == 1, verdict
    assert samples[("vllm:kvgate_abandoned_lookups_total", labels("0"))] == 1


def test_the_workers_counts_summed_over_ranks(got: dict[str, Any]) -> None:
    samples = kvgate_samples(got["text"])
    block = got["block_bytes"]

    def count(name: str, **more: str) -> float:
        return samples[(name, labels("0", **more))]

    # rank 0 (gateway down): 4 blocks found no store buffer (one request), then 2 failed to PUT
    assert count("vllm:kvgate_stores_dropped_total", reason="buffer") == 4
    assert count("vllm:kvgate_stores_dropped_total", reason="failed") == 2
    assert count("vllm:kvgate_stores_dropped_total", reason="budget") == 0
    assert count("vllm:kvgate_stores_dropped_total", reason="gateway_full") == 0
    assert count("vllm:kvgate_store_requests_dropped_total") == 1
    # rank 1 (a gateway): 3 blocks stored, then loaded back
    assert count("vllm:kvgate_stored_blocks_total") == 3
    assert count("vllm:kvgate_stored_bytes_total") == 3 * block
    assert count("vllm:kvgate_loaded_blocks_total") == 3
    assert count("vllm:kvgate_loaded_bytes_total") == 3 * block
    assert count("vllm:kvgate_load_failed_blocks_total") == 0


def test_bytes_held_are_each_ranks_newest_summed(got: dict[str, Any]) -> None:
    p1, p2, p3 = got["steps"]
    store, load = got["store_buffer_bytes"], got["load_buffer_bytes"]
    # step 1: rank 0 holds every store buffer, rank 1 one load buffer; step 2: each rank holds one load buffer
    assert p1["store_bytes_held"] == {"0": got["store_buffers"] * store} and p1["load_bytes_held"] == {"1": load}
    assert p2["store_bytes_held"] == {"0": 0} and p2["load_bytes_held"] == {"0": load, "1": load}
    samples = kvgate_samples(got["text"])
    assert samples[("vllm:kvgate_store_host_bytes_held", labels("0"))] == 0
    assert samples[("vllm:kvgate_load_host_bytes_held", labels("0"))] == 2 * load
    # step 3: all given back; each rank says 0 once, then nothing
    assert p3 == {"load_bytes_held": {"0": 0, "1": 0}}
    assert got["again"] == [None, None]
    quiet = kvgate_samples(got["quiet"])
    assert quiet == want_samples(got, [p1, p2, p3])
    assert quiet[("vllm:kvgate_load_host_bytes_held", labels("0"))] == 0


def test_the_log_line_sums_counts_and_keeps_each_ranks_newest_bytes(got: dict[str, Any]) -> None:
    (line,) = got["logged"]
    assert line.startswith("KV Transfer metrics: ")
    logged = dict(item.split("=", 1) for item in line.removeprefix("KV Transfer metrics: ").split(", "))
    # two steps in one interval: the bytes held are the ranks' newest summed (not summed over the steps)
    assert int(logged["load_bytes_held"]) == 2 * got["load_buffer_bytes"]
    assert int(logged["store_bytes_held"]) == 0
    assert int(logged["store_drops_buffer"]) == 4 and int(logged["store_drops_failed"]) == 2
    assert int(logged["stored_blocks"]) == 3 and int(logged["loaded_blocks"]) == 3
    assert int(logged["loads"]) == sum(r.get("loads", 0) for r in got["reports"])


def test_unknown_keys_and_engines_are_ignored(got: dict[str, Any]) -> None:
    text = got["text"]
    assert "someday" not in text
    assert 'engine="7"' not in text
    names = {name for name, _ in kvgate_samples(text)}
    assert names == {
        "vllm:kvgate_decisions_total",
        "vllm:kvgate_stores_dropped_total",
        *COUNTERS.values(),
        *GAUGES.values(),
        *WORKER.values(),
        *HELD.values(),
    }
