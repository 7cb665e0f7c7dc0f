"""KVGateTier built by vLLM 0.33's own tier factory (TieringOffloadingSpec.get_manager) against a real gateway."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import matches
from tests.gateway import Gateway
from tests.vllm.tier_harness import rows, run_driver

pytestmark = pytest.mark.vllm

SCHEDULER_BOUND_S = 0.5
"""No call on the scheduler's thread may take longer than this (a correctness bound, not a speed figure)."""


def request_count(metrics: str, *, method: str, route: str) -> float:
    """Sum of kvgate_requests_total over statuses for one method and the route templates starting with ``route``."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("kvgate_requests_total{") and f'method="{method}"' in line and f'route="{route}' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_factory_built_tier_stores_and_loads_rows_byte_identical(
    vllm_python: str, gateway: Gateway, tmp_path: Path
) -> None:
    data_root = gateway.data_dir / "blocks"
    out = tmp_path / "out"
    report = run_driver(vllm_python, "roundtrip", out, url=gateway.url, data_root=data_root)
    stored = rows(out, count=4)

    # vLLM's factory resolved the out-of-tree tier and handed it the primary tier's real memoryview.
    assert report["tier_class"] == "connector.vllm.tier.KVGateTier"
    assert report["view"] == {"shape": [16, 65536], "strides": [65536, 1], "format": "b"}

    assert report["before"][0] == ["MISS"] * 4
    assert report["store"] == {"1001": {"success": True, "successful_keys": None, "bytes": 4 * 65536}}
    assert report["events"] == [4]
    assert report["after"][0] == ["HIT"] * 4
    assert report["restore"] == {"1002": {"success": True, "successful_keys": None, "bytes": None}}
    assert report["load"]["1003"]["success"] is True
    assert report["load_equal"] == [True] * 4

    # A corrupt file (same size, other bytes) and a truncated one: the load fails for exactly those two keys,
    # their slots keep the sentinel, the good ones are reported loaded, and the bad ones turn into misses.
    assert report["bad_load"]["1004"] == {"success": False, "successful_keys": 2, "bytes": 2 * 65536}
    assert report["bad_slots"] == [True, True, True]
    assert report["after_bad"][0] == ["HIT", "MISS", "MISS", "HIT"]
    # Served whole but not a row's bytes (bit rot under the old ETag, a valid half-row object) and a 404: the load
    # reads each straight into its slot and reports none of them loaded (vLLM never reads those slots).
    assert report["more_store"] == {"1005": {"success": True, "successful_keys": None, "bytes": 2 * 65536}}
    assert report["short_put"] == 200  # it replaces the row
    assert report["before_served_bad"][0] == ["HIT", "HIT", "MISS"]
    assert report["served_bad_load"]["1006"] == {"success": False, "successful_keys": None, "bytes": None}
    assert report["after_served_bad"][0] == ["MISS"] * 3  # and the tier stops promoting them
    assert report["worst_call_s"] < SCHEDULER_BOUND_S

    # The gateway serves the same bytes over HTTP under vLLM's FileMapper keys (the untouched rows 0 and 3).
    with httpx.Client(base_url=gateway.url, timeout=10.0) as c:
        for i in (0, 3):
            r = c.get(f"/v1/blocks/{report['paths'][i]}")
            assert r.status_code == 200
            assert r.content == stored[i]
            assert matches(r.headers["etag"], stored[i])
        assert c.get(f"/v1/namespaces/{report['namespace']}/config").json() == report["run_config"]
        metrics = c.get("/metrics").text

    # Lookups went out as one batched POST /v1/lookup per step with new keys (three here), never a HEAD per key.
    assert request_count(metrics, method="POST", route="/v1/lookup") == 3
    assert request_count(metrics, method="HEAD", route="/v1/blocks/") == 0
    assert request_count(metrics, method="PUT", route="/v1/blocks/") == 4 + 2 + 1  # the re-store sent nothing
    assert request_count(metrics, method="GET", route="/v1/blocks/") >= 2 + 4  # the label is right

    # config.json on disk is what vLLM's fs tier writes: json.dump(fields, indent=2, sort_keys=True).
    config_file = data_root / report["namespace"] / "config.json"
    assert config_file.read_text() == json.dumps(report["run_config"], indent=2, sort_keys=True)
