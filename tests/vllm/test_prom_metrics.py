"""KVGateConnector's Prometheus metrics under the real vLLM 0.33.0 (tests/vllm/oracle_metrics.py, in the oracle venv):
vLLM's ``KVConnectorProm`` builds them through ``build_prom_metrics`` and observes two reports of a real planner;
the ``generate_latest()`` text holds each count's sum and each estimate's latest value, and nothing else.

The names below are what dashboards query (docs/connector-metrics.md): renaming one breaks them, so it fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from connector.cost import Verdict
from connector.plan import PlanStats
from tests.vllm.test_interop import oracle, result

pytestmark = pytest.mark.vllm

DECISIONS = {"loads": "load", "partial": "partial", "skipped": "skip", "probes": "probe", "abandoned": "abandoned"}
"""Report key -> ``verdict`` of vllm:kvgate_decisions_total."""
COUNTERS = {
    "abandoned_lookups": "vllm:kvgate_abandoned_lookups_total",
    "predicted_load_s": "vllm:kvgate_predicted_load_seconds_total",
    "actual_load_s": "vllm:kvgate_load_seconds_total",
}
GAUGES = {"bandwidth_mib_s": "vllm:kvgate_bandwidth_mib_s", "prefill_tokens_s": "vllm:kvgate_prefill_tokens_s"}
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


@pytest.fixture(scope="module")
def got(vllm_python: str) -> dict[str, Any]:
    return result(oracle(vllm_python, "oracle_metrics.py"))


def test_build_prom_metrics_registers_the_connectors_metrics(got: dict[str, Any]) -> None:
    assert got["built"] == "KVGatePromMetrics"


def test_counters_hold_the_sums_and_gauges_the_latest(got: dict[str, Any]) -> None:
    r1, r2 = got["reports"]
    # the scenario made every key of the report: every metric below is checked against a count it saw
    assert set(r1) | set(r2) == set(PlanStats.COUNTERS) | set(GAUGES), (r1, r2)
    assert r2["bandwidth_mib_s"] != r1["bandwidth_mib_s"]
    samples = kvgate_samples(got["text"])
    want: Samples = {}
    for engine in ENGINES:
        observed = [r1, r2] if engine == "0" else []
        for key, verdict in DECISIONS.items():
            total = sum(r.get(key, 0) for r in observed)
            want[("vllm:kvgate_decisions_total", labels(engine, verdict=verdict))] = total
        for key, name in COUNTERS.items():
            want[(name, labels(engine))] = sum(r.get(key, 0) for r in observed)
        for key, name in GAUGES.items():
            if observed:  # an engine's estimates appear with its first report
                want[(name, labels(engine))] = r2[key]
    assert set(samples) == set(want), sorted(set(samples) ^ set(want))
    for k, value in want.items():
        assert samples[k] == pytest.approx(value, rel=1e-9), k
    # what the scenario decided, once each
    for verdict in ("load", "partial", "skip", "probe", "abandoned"):
        assert samples[("vllm:kvgate_decisions_total", labels("0", verdict=verdict))] == 1, verdict
    assert samples[("vllm:kvgate_abandoned_lookups_total", labels("0"))] == 1


def test_unknown_keys_and_engines_are_ignored(got: dict[str, Any]) -> None:
    text = got["text"]
    assert "someday" not in text
    assert 'engine="7"' not in text
    names = {name for name, _ in kvgate_samples(text)}
    assert names == {"vllm:kvgate_decisions_total", *COUNTERS.values(), *GAUGES.values()}
