"""The vLLM side of tests/vllm/test_tier*.py: run by the oracle venv's python (real vLLM 0.33.0), never by pytest.

    python -m tests.vllm.tier_driver SCENARIO --out DIR [options]
    python -m tests.vllm.tier_driver serve        (JSON requests on stdin; what the tests use)

Each scenario builds tiers through vLLM's own TieringOffloadingSpec / SecondaryTierFactory from spec dicts, moves
rows, writes ``DIR/report.json`` (and ``DIR/rows.bin``: the rows it stored, concatenated) for the test to check.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

from loopback.vllm_tier import (
    ROW_BYTES,
    Steps,
    fill,
    keys_for,
    kvgate_tier_cfg,
    make_spec,
    primary_view,
    row,
    standalone_tier,
)


def lookups_until_hit(steps: Steps, keys: list[bytes], req: str, *, timeout_s: float) -> tuple[list[str], float, int]:
    """Look up ``keys`` (known stored) again until all are hits or ``timeout_s`` passes: the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = steps.lookups(keys, req, timeout_s=timeout_s)
        if result[0] == ["HIT"] * len(keys) or time.monotonic() > deadline:
            return result
        time.sleep(0.02)


def summary(results: dict[int, Any]) -> dict[str, Any]:
    return {
        str(j): {
            "success": r.success,
            "successful_keys": None if r.successful_keys is None else len(r.successful_keys),
            "bytes": r.transfer_bytes,
        }
        for j, r in sorted(results.items())
    }


# -- scenarios -----------------------------------------------------------------------------------------------------


def tls_context(extra: dict[str, Any]) -> ssl.SSLContext | None:
    """The client side of the tier's TLS keys (``ca_file``, ``cert_file``, ``key_file``) for a raw request the
    scenario sends beside the tier; None over plain HTTP."""
    if not extra.get("ca_file"):
        return None
    ctx = ssl.create_default_context(cafile=extra["ca_file"])
    if extra.get("cert_file"):
        ctx.load_cert_chain(extra["cert_file"], extra.get("key_file"))
    return ctx


def roundtrip(args: argparse.Namespace) -> dict[str, Any]:
    """Factory-built tier (spec.get_manager()), real primary memoryview: store rows, look up, load, corrupt."""
    spec = make_spec([kvgate_tier_cfg(args.url, **(args.tier_extra or {}))])  # tier_extra: e.g. the TLS keys
    manager = spec.get_manager()
    tier = manager.secondary_tiers[0]
    view = tier._primary_kv_view
    steps = Steps(tier)
    keys = keys_for(4, "roundtrip")
    rows = fill(view, range(4), seed=1)
    report: dict[str, Any] = {
        "tier_class": f"{type(tier).__module__}.{type(tier).__name__}",
        "view": {"shape": list(view.shape), "strides": list(view.strides), "format": view.format},
    }
    report["paths"] = [tier.key_path(k) for k in keys]
    report["run_config"] = tier.file_mapper.get_run_config()
    report["namespace"] = tier.namespace
    report["before"] = steps.lookups(keys, "req-a")
    stored = steps.wait({steps.job(keys, [0, 1, 2, 3], load=False)})
    report["store"] = summary(stored)
    report["events"] = [len(e.keys) for e in steps.call("take_events", tier.take_events)]
    steps.finish("req-a")
    report["after"] = steps.lookups(keys, "req-b")
    report["restore"] = summary(steps.wait({steps.job(keys, [0, 1, 2, 3], load=False, req="req-b")}))  # known: not sent
    for cid in range(4, 8):  # slots to load into: fill with a sentinel first
        view.cast("B")[cid * ROW_BYTES : (cid + 1) * ROW_BYTES] = b"\xee" * ROW_BYTES
    loaded = steps.wait({steps.job(keys, [4, 5, 6, 7], load=True, req="req-b")})
    report["load"] = summary(loaded)
    report["load_equal"] = [row(view, 4 + i) == rows[i] for i in range(4)]
    # Corrupt one stored file (same size, other bytes) and truncate another, behind the gateway's back.
    root = Path(args.data_root)
    (root / report["paths"][1]).write_bytes(b"\x00" * ROW_BYTES)
    with (root / report["paths"][2]).open("r+b") as f:
        f.truncate(ROW_BYTES // 2)
    for cid in range(8, 12):
        view.cast("B")[cid * ROW_BYTES : (cid + 1) * ROW_BYTES] = b"\xee" * ROW_BYTES
    bad = steps.wait({steps.job(keys, [8, 9, 10, 11], load=True, req="req-b")})
    report["bad_load"] = summary(bad)
    report["bad_slots"] = [row(view, 8 + i) == rows[i] for i in (0,)] + [
        row(view, 8 + i) == b"\xee" * ROW_BYTES for i in (1, 2)
    ]
    report["after_bad"] = steps.lookups(keys, "req-b")
    # Bytes the gateway serves whole but a row must not take (the load reads them straight into the row's slot):
    # two more rows stored, then bit rot in the first's file (size and mtime kept, so the gateway serves it under its
    # old ETag) and a valid object of half a row PUT under the second; with key 1, which the gateway no longer has
    # (404). None of the three is reported loaded.
    more = keys_for(2, "served-bad")
    more_rows = fill(view, range(12, 14), seed=2)
    report["more_store"] = summary(steps.wait({steps.job(more, [12, 13], load=False, req="req-c")}))
    more_paths = [tier.key_path(k) for k in more]
    rotten = root / more_paths[0]
    st = rotten.stat()
    with rotten.open("r+b") as f:
        f.seek(7)
        f.write(bytes([more_rows[0][7] ^ 1]))
    os.utime(rotten, ns=(st.st_atime_ns, st.st_mtime_ns))
    put = urllib.request.Request(f"{args.url}/v1/blocks/{more_paths[1]}", data=more_rows[1][: ROW_BYTES // 2])
    put.method = "PUT"
    with urllib.request.urlopen(put, timeout=10, context=tls_context(args.tier_extra or {})) as resp:
        report["short_put"] = resp.status
    for cid in range(12, 15):
        view.cast("B")[cid * ROW_BYTES : (cid + 1) * ROW_BYTES] = b"\xee" * ROW_BYTES
    report["before_served_bad"] = steps.lookups([*more, keys[1]], "req-c")  # as vLLM looks up, then loads
    report["served_bad_load"] = summary(steps.wait({steps.job([*more, keys[1]], [12, 13, 14], load=True, req="req-c")}))
    report["after_served_bad"] = steps.lookups([*more, keys[1]], "req-c")
    steps.finish("req-c")
    steps.finish("req-b")
    report["worst_call_s"] = steps.worst_s
    Path(args.out, "rows.bin").write_bytes(b"".join(rows))
    manager.shutdown()
    return report


def fs_write(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's own fs tier writes rows into ``--root`` (the import test serves them from kvgate)."""
    spec = make_spec([{"type": "fs", "root_dir": args.root, "n_read_threads": 2, "n_write_threads": 2}])
    manager = spec.get_manager()
    tier = manager.secondary_tiers[0]
    view = tier._primary_kv_view
    steps = Steps(tier)
    keys = keys_for(6, "fs-write")
    rows = fill(view, range(6), seed=2)
    stored = steps.wait({steps.job(keys, list(range(6)), load=False)})
    root = args.root.rstrip("/") + "/"
    report = {
        "store": summary(stored),
        "paths": [tier.file_mapper.get_file_name(k).removeprefix(root) for k in keys],
        "config_path": tier.file_mapper.get_config_file_path().removeprefix(root),
        "run_config": tier.file_mapper.get_run_config(),
    }
    Path(args.out, "rows.bin").write_bytes(b"".join(rows))
    manager.shutdown()
    return report


def kvgate_then_fs(args: argparse.Namespace) -> dict[str, Any]:
    """Store through KVGateTier, then read back with vLLM's fs tier pointed at the gateway's data root."""
    spec = make_spec([])
    view = primary_view()
    tier = standalone_tier(spec, kvgate_tier_cfg(args.url), view)
    steps = Steps(tier)
    keys = keys_for(5, "kvgate-then-fs")
    rows = fill(view, range(5), seed=3)
    report: dict[str, Any] = {"store": summary(steps.wait({steps.job(keys, list(range(5)), load=False)}))}
    tier.shutdown()
    config_file = Path(args.root, tier.namespace, "config.json")
    report["config_before"] = config_file.read_bytes().decode()
    fresh = Path(args.out, "fresh-fs-root")  # what vLLM's fs tier itself writes as config.json
    fresh_tier = standalone_tier(spec, {"type": "fs", "root_dir": str(fresh)}, primary_view())
    report["config_vllm"] = Path(fresh_tier.file_mapper.get_config_file_path()).read_bytes().decode()
    fresh_tier.shutdown()

    fs = standalone_tier(spec, {"type": "fs", "root_dir": args.root, "n_read_threads": 2, "n_write_threads": 2}, view)
    fs_steps = Steps(fs)
    report["fs_lookup"] = fs_steps.lookups(keys, "req-fs")
    for cid in range(8, 13):
        view.cast("B")[cid * ROW_BYTES : (cid + 1) * ROW_BYTES] = b"\xee" * ROW_BYTES
    report["fs_load"] = summary(fs_steps.wait({fs_steps.job(keys, list(range(8, 13)), load=True, req="req-fs")}))
    report["fs_equal"] = [row(view, 8 + i) == rows[i] for i in range(5)]
    report["config_after"] = config_file.read_bytes().decode()
    fs_steps.finish("req-fs")
    fs.shutdown()
    return report


def outage(args: argparse.Namespace) -> dict[str, Any]:
    """Gateway down (nothing listening), then slow (the real gateway SIGSTOPped), then back."""
    spec = make_spec([])
    fast = {
        "connect_timeout_s": 0.3,
        "lookup_timeout_s": 0.3,
        "transfer_timeout_s": 1.0,
        "retries": 1,
        "down_cooldown_s": 1.0,
    }
    report: dict[str, Any] = {}

    view = primary_view()
    down = standalone_tier(spec, kvgate_tier_cfg(args.down_url, **fast), view)
    steps = Steps(down)
    keys = keys_for(8, "down")
    fill(view, range(8), seed=4)
    report["down_lookup"] = steps.lookups(keys[:4], "d1")
    report["down_store"] = summary(steps.wait({steps.job(keys[:4], [0, 1, 2, 3], load=False)}))
    report["down_load"] = summary(steps.wait({steps.job(keys[4:], [4, 5, 6, 7], load=True, req="d1")}))
    report["down_lookup_again"] = steps.lookups(keys[4:], "d2")
    t0 = time.monotonic()
    down.shutdown()
    report["down_shutdown_s"] = time.monotonic() - t0
    report["down_worst_call"] = [steps.worst_s, steps.worst_call]

    view = primary_view()
    slow = standalone_tier(spec, kvgate_tier_cfg(args.url, **fast), view)
    steps = Steps(slow)
    fill(view, range(8), seed=5)
    healthy = keys_for(8, "healthy")
    report["healthy_store"] = summary(steps.wait({steps.job(healthy[:4], [0, 1, 2, 3], load=False)}))
    os.kill(args.pid, signal.SIGSTOP)
    try:
        job = steps.job(healthy[4:], [4, 5, 6, 7], load=False)  # sent before the circuit opens: times out
        report["slow_lookup"] = steps.lookups(healthy[4:], "s1")
        report["slow_store"] = summary(steps.wait({job}, timeout_s=10.0))
        report["slow_lookup_hit_keys"] = steps.lookups(healthy[:4], "s2")  # stored earlier: circuit says MISS
        t0 = time.monotonic()
        steps.call("drain_jobs", slow.drain_jobs)
        report["slow_drain_s"] = time.monotonic() - t0
        report["slow_worst_call"] = [steps.worst_s, steps.worst_call]
    finally:
        os.kill(args.pid, signal.SIGCONT)
    steps.finish("s1")
    steps.finish("s2")
    # the circuit's cooldown: lookups of rows stored before the stall answer MISS until it closes, HIT after
    report["recovered_lookup"] = lookups_until_hit(steps, healthy[:4], "s3", timeout_s=10.0)
    for cid in range(8, 12):
        view.cast("B")[cid * ROW_BYTES : (cid + 1) * ROW_BYTES] = b"\xee" * ROW_BYTES
    report["recovered_load"] = summary(steps.wait({steps.job(healthy[:4], [8, 9, 10, 11], load=True, req="s3")}))
    report["recovered_equal"] = [row(view, 8 + i) == row(view, i) for i in range(4)]
    slow.shutdown()
    return report


def deadline(args: argparse.Namespace) -> dict[str, Any]:
    """Rows stored through the gateway, then loaded through ``args.stall_url`` (a proxy that stops passing answers
    half-way) with a 30 s transfer timeout and a 1 s load deadline."""
    spec = make_spec([])
    report: dict[str, Any] = {}
    view = primary_view()
    keys = keys_for(4, "deadline")
    fill(view, range(4), seed=7)
    writer = standalone_tier(spec, kvgate_tier_cfg(args.url), view)
    steps = Steps(writer)
    report["store"] = summary(steps.wait({steps.job(keys, [0, 1, 2, 3], load=False)}))
    writer.shutdown()
    view = primary_view()
    fill(view, range(4), seed=7)
    for cid in range(4, 8):
        view.cast("B")[cid * ROW_BYTES : (cid + 1) * ROW_BYTES] = b"\xee" * ROW_BYTES
    stalled = standalone_tier(
        spec, kvgate_tier_cfg(args.stall_url, transfer_timeout_s=30.0, load_deadline_ms=1000.0, retries=1), view
    )
    steps = Steps(stalled)
    t0 = time.monotonic()
    results = steps.wait({steps.job(keys, [4, 5, 6, 7], load=True)}, timeout_s=60.0)
    report["load_s"] = time.monotonic() - t0
    report["load"] = summary(results)
    (result,) = results.values()
    loaded = {bytes(k) for k in result.successful_keys or ()}
    report["loaded_equal"] = [row(view, 4 + i) == row(view, i) for i, k in enumerate(keys) if k in loaded]
    report["load_deadlines"] = stalled.load_deadlines
    stalled.shutdown()
    return report


def full(args: argparse.Namespace) -> dict[str, Any]:
    """A gateway too small for a row (every store is a 507), then a misspelt key in the tier's entry."""
    spec = make_spec([])
    report: dict[str, Any] = {}
    view = primary_view()
    tier = standalone_tier(spec, kvgate_tier_cfg(args.url, retries=2, down_cooldown_s=30.0), view)
    steps = Steps(tier)
    keys = keys_for(4, "full")
    fill(view, range(4), seed=6)
    report["full_store"] = summary(steps.wait({steps.job(keys, [0, 1, 2, 3], load=False)}))
    stats = tier._client.stats
    report["full_stats"] = {"full_stores": stats.full_stores, "retries": stats.retries}
    report["full_gateway_down"] = tier._client.gateway_down
    report["full_lookup"] = steps.lookups(keys, "f1")  # sent to the gateway (RETRY first), not short-circuited
    report["full_gateway_down_after"] = tier._client.gateway_down
    tier.shutdown()
    try:
        standalone_tier(spec, kvgate_tier_cfg(args.url, retires=1), primary_view())
    except Exception as exc:  # the settings error, at construction
        report["misspelt"] = [type(exc).__name__, str(exc)]
    return report


def meta(args: argparse.Namespace) -> dict[str, Any]:
    from tests.vllm.tier_meta_scenario import meta as scenario

    return scenario(args)


SCENARIOS = {
    "meta": meta,
    "roundtrip": roundtrip,
    "fs-write": fs_write,
    "kvgate-then-fs": kvgate_then_fs,
    "outage": outage,
    "deadline": deadline,
    "full": full,
}


REPLY = "KVGATE-DRIVER "
"""Prefix of the serve loop's reply lines (vLLM may log to stdout too)."""


def run(scenario: str, options: dict[str, Any]) -> dict[str, Any]:
    args = argparse.Namespace(
        **{"url": None, "down_url": None, "data_root": None, "root": None, "pid": None, "tier_extra": None, **options}
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = SCENARIOS[scenario](args)
    Path(args.out, "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def serve() -> None:
    """One JSON request per stdin line ({"scenario", "options"}); one reply line each: vLLM is imported once."""
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            run(request["scenario"], request["options"])
            reply: dict[str, Any] = {"ok": True}
        except BaseException:
            reply = {"ok": False, "error": traceback.format_exc()}
        print(REPLY + json.dumps(reply), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=[*sorted(SCENARIOS), "serve"])
    parser.add_argument("--out")
    parser.add_argument("--url")
    parser.add_argument("--down-url")
    parser.add_argument("--data-root")
    parser.add_argument("--root")
    parser.add_argument("--pid", type=int)
    args = parser.parse_args()
    if args.scenario == "serve":
        serve()
        return
    options = {k: v for k, v in vars(args).items() if k != "scenario"}
    run(args.scenario, options)


if __name__ == "__main__":
    main()
