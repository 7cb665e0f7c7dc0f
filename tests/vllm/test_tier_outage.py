"""Gateway down or stalled: the tier answers MISS, drops stores, and never holds the scheduler's thread."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopback.proxy import proxy
from tests.gateway import Gateway, free_port
from tests.vllm.tier_harness import run_driver

pytestmark = pytest.mark.vllm

SCHEDULER_BOUND_S = 0.5
"""Worst duration of any one tier call on the scheduler's thread (correctness bound, not a benchmark)."""
ROW_BYTES = 64 * 1024
"""tier_driver.ROW_BYTES (that module imports vllm: the oracle's python only)."""
TRANSFER_TIMEOUT_S = 1.0
"""The driver's transfer_timeout_s: drain_jobs may wait this long (plus slack) for a stalled transfer."""


def test_down_and_stalled_gateway_never_blocks_the_scheduler(
    vllm_python: str, gateway: Gateway, tmp_path: Path
) -> None:
    assert gateway.proc is not None
    down_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = run_driver(vllm_python, "outage", tmp_path / "out", url=gateway.url, down_url=down_url, pid=gateway.proc.pid)

    # Down: lookups resolve to MISS within a few steps, then at once; stores and loads fail (dropped).
    assert r["down_lookup"][0] == ["MISS"] * 4
    assert r["down_lookup"][1] < 2.0
    assert r["down_lookup_again"][0] == ["MISS"] * 4
    assert r["down_lookup_again"][2] == 1  # the circuit is open: answered on the first step, no RETRY
    assert r["down_store"]["1001"]["success"] is False
    assert r["down_load"]["1002"]["success"] is False
    assert r["down_worst_call"][0] < SCHEDULER_BOUND_S
    assert r["down_shutdown_s"] < SCHEDULER_BOUND_S

    # Stalled (SIGSTOP): lookups turn MISS after the lookup timeout, the in-flight store fails after the transfer
    # timeout and is reported failed, drain_jobs is bounded, and no scheduler call waited.
    assert r["healthy_store"]["1001"]["success"] is True
    assert r["slow_lookup"][0] == ["MISS"] * 4
    assert r["slow_lookup"][1] < 2.0
    assert r["slow_store"]["1002"]["success"] is False
    assert r["slow_lookup_hit_keys"][0] == ["MISS"] * 4  # present, but the gateway cannot serve them now
    assert r["slow_drain_s"] < TRANSFER_TIMEOUT_S + 1.0
    assert r["slow_worst_call"][0] < SCHEDULER_BOUND_S

    # Back (SIGCONT, cooldown over): the rows stored before the stall are hits and load byte-identical.
    assert r["recovered_lookup"][0] == ["HIT"] * 4
    assert all(job["success"] for job in r["recovered_load"].values())
    assert r["recovered_equal"] == [True] * 4


def test_a_stalled_load_costs_its_deadline_not_the_transfer_timeout(
    vllm_python: str, gateway: Gateway, tmp_path: Path
) -> None:
    """The gateway stops answering half-way through a load job: the job reports at its deadline (1 s), not after
    the 30 s transfer timeout, with only the rows that arrived whole as loaded, and those byte-equal."""
    with proxy(upstream_port=gateway.port, pass_bytes=ROW_BYTES * 3 // 2) as link:
        r = run_driver(vllm_python, "deadline", tmp_path / "out", url=gateway.url, stall_url=link.url)
    assert r["store"]["1001"]["success"] is True
    (load,) = r["load"].values()
    assert load["success"] is False and (load["successful_keys"] or 0) <= 1
    assert r["load_s"] < 10.0, r["load_s"]  # the transfer timeout is 30 s (with a retry)
    assert r["load_deadlines"] == 1
    assert all(r["loaded_equal"]) and len(r["loaded_equal"]) == (load["successful_keys"] or 0)


def test_full_gateway_is_not_down_and_a_misspelt_key_fails(vllm_python: str, tmp_path: Path) -> None:
    """507 (the store is full): the rows are dropped and counted, the circuit stays closed and lookups still reach
    the gateway. A misspelt key in the tier's entry stops its construction with a message naming it."""
    gw = Gateway(tmp_path / "data", env={"KVGATE_MAX_BYTES": str(32 * 1024)}).start()  # half a row
    try:
        r = run_driver(vllm_python, "full", tmp_path / "out", url=gw.url)
    finally:
        gw.stop()
    assert r["full_store"]["1001"]["success"] is False
    assert r["full_stats"] == {"full_stores": 4, "retries": 0}
    assert r["full_gateway_down"] is False
    verdicts, _seconds, steps = r["full_lookup"]
    assert verdicts == ["MISS"] * 4 and steps >= 2  # answered by the gateway, not by an open circuit
    assert r["full_gateway_down_after"] is False
    kind, message = r["misspelt"]
    assert kind == "SettingsError"
    assert "'retires'" in message and "transfer_timeout_s" in message
