"""KVGateConnector's Prometheus metrics: the cost model's decisions (``SchedulerPlanner.report``) as vLLM metrics.

vLLM builds them once per logger through ``KVGateConnector.build_prom_metrics``, with its own metric classes (plain
prometheus_client, or Ray's wrappers), label names (``model_name``, ``engine``) and per-engine label values, and
hands every scheduler step's stats dict to ``observe``. A stats dict holds what changed since the last report
(counts, added to counters) and the estimates now (set on gauges); a key this module does not know is ignored, so a
newer connector runs against an older dashboard. docs/connector-metrics.md says how to read them.
"""

from __future__ import annotations

import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from connector.cost import Verdict

PREFIX = "vllm:kvgate_"

DECISIONS: dict[str, str] = {
    "loads": Verdict.LOAD,
    "partial": Verdict.PARTIAL,
    "skipped": Verdict.SKIP,
    "probes": Verdict.PROBE,
    "abandoned": "abandoned",
}
"""Report key -> the ``verdict`` label of ``vllm:kvgate_decisions_total``. "abandoned" is what became of a load
(load, partial or probe) that ran out of its deadline, counted when it ended."""

COUNTERS: dict[str, tuple[str, str]] = {
    "abandoned_lookups": (
        "abandoned_lookups",
        "Lookups with no answer within the lookup deadline: a miss, never a wait.",
    ),
    "predicted_load_s": (
        "predicted_load_seconds",
        "Sum of the cost model's predicted times of the loads that ended (compare with vllm:kvgate_load_seconds).",
    ),
    "actual_load_s": (
        "load_seconds",
        "Sum of the times the loads that ended took, on the slowest worker rank.",
    ),
}
"""Report key -> (metric name after the prefix, its help): counts, summed. A counter's exposed name ends in
``_total``."""

GAUGES: dict[str, tuple[str, str]] = {
    "bandwidth_mib_s": (
        "bandwidth_mib_s",
        "The cost model's estimate of the load bandwidth (MiB/s) the next load will get.",
    ),
    "prefill_tokens_s": (
        "prefill_tokens_s",
        "The cost model's estimate of the engine's prefill rate (tokens/s); 0: unknown (no setting, none measured).",
    ),
}
"""Report key -> (metric name after the prefix, its help): estimates, the latest kept."""


def _number(value: Any) -> float | None:
    """A finite int or float (not a bool); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class KVGatePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vllm is untyped here
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = self.per_engine_labelvalues.items()
        decisions = self._counter_cls(
            name=f"{PREFIX}decisions",
            documentation="The cost model's decisions per hit (verdict: load, partial, skip, probe), and the loads "
            "that ran out of their deadline (verdict: abandoned).",
            labelnames=[*labelnames, "verdict"],
        )
        # every count exists from the start, at 0: rate() and the shares work before the first of each verdict
        self._counters: dict[int, dict[str, Any]] = {
            idx: {key: decisions.labels(*values, verdict) for key, verdict in DECISIONS.items()}
            for idx, values in engines
        }
        for key, (name, doc) in COUNTERS.items():
            counter = self._counter_cls(name=f"{PREFIX}{name}", documentation=doc, labelnames=labelnames)
            for idx, values in engines:
                self._counters[idx][key] = counter.labels(*values)
        # an engine's estimates appear with its first report: a 0 before it would read as a dead link
        self._gauge_metrics = {
            key: self._gauge_cls(
                name=f"{PREFIX}{name}", documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"
            )
            for key, (name, doc) in GAUGES.items()
        }
        self._gauges: dict[int, dict[str, Any]] = {idx: {} for idx, _ in engines}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        counters, gauges = self._counters.get(engine_idx), self._gauges.get(engine_idx)
        if counters is None or gauges is None:
            return  # an engine it was not built for
        for key, raw in transfer_stats_data.items():
            value = _number(raw)
            if value is None:
                continue
            if key in counters:
                if value > 0:  # a count since the last report: never negative
                    counters[key].inc(value)
            elif key in self._gauge_metrics:
                if key not in gauges:
                    gauges[key] = self._gauge_metrics[key].labels(*self.per_engine_labelvalues[engine_idx])
                gauges[key].set(value)
            # any other key: a newer connector's, ignored
