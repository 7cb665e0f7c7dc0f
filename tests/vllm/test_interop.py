"""Interop with the real vLLM 0.33.0, run in a subprocess of the oracle venv's python (the project venv has none).

The oracle needs the connector's own dependencies too: ``<oracle>/bin/pip install httpx aiohttp einops``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from contract.keys import (
    CANONICAL_FORMAT,
    KVGroup,
    block_path,
    config_path,
    make_offload_key,
    namespace_for,
    naming,
    run_fields,
)
from tests.gateway import REPO, Gateway

pytestmark = pytest.mark.vllm
HERE = Path(__file__).parent

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "num_hidden_layers": 4,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
}


def oracle(python: str, script: str, *args: str, stdin: str | None = None, timeout: float = 240) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [python, str(HERE / script), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    if proc.returncode != 0:
        raise AssertionError(f"oracle {script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def result(stdout: str) -> dict[str, Any]:
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))


def test_subclass_of_the_real_base_class(vllm_python: str) -> None:
    got = result(oracle(vllm_python, "oracle_connector.py", "-", "-", "subclass"))
    assert got["subclass"] is True and got["hma"] is True
    assert got["abstract"] == []
    assert got["init_params"] == got["base_init_params"] == ["self", "vllm_config", "role", "kv_cache_config"]


def test_both_roles_through_vllms_factory(vllm_python: str, gateway: Gateway, tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    got = result(oracle(vllm_python, "oracle_connector.py", gateway.url, str(model), "roles"))
    assert (got["sched_role"], got["worker_role"]) == ("SCHEDULER", "WORKER")
    assert got["agnostic"] is True
    assert got["hash_len"] == 32  # sha256 block hashes
    assert got["matched_before"] == [0, False]  # nothing stored yet: a miss
    assert got["stored"] == 3 and got["sending"] == ["w"]
    assert got["preempted"] == ["w"]  # SchedulerOutput.preempted_req_ids reaches handle_preemptions
    assert got["prefix"] == 3
    assert got["matched_after"] == [3 * 16, True]  # 3 full blocks of a 53-token prompt, loaded async
    assert got["recving"] == ["r"] and got["errors"] == []
    assert got["equal"] is True
    # the load's measurement reached the scheduler through vLLM's worker metadata; the one decision was a load
    assert got["worker_meta"] == "KVGateWorkerMetadata" and got["measured_load_s"] > 0
    assert got["decisions"] == [1, 0, 0]
    logged = got["logged"]
    assert logged["loads"] == 1 and logged["actual_load_s"] > 0 and logged["bandwidth_mib_s"] > 0
    assert got["stats_again"] is True  # each report holds what changed since the last


def _cases() -> list[dict[str, Any]]:
    h64 = [hashlib.sha256(f"b{i}".encode()).hexdigest() for i in range(3)]
    h32 = [hashlib.md5(f"x{i}".encode()).hexdigest() for i in range(3)]  # the width of vLLM's xxhash-128 variants
    two_groups = [
        {"tokens_per_block": 16, "layer_names": ["l.0", "l.2"]},
        {"tokens_per_block": 32, "layer_names": ["l.1", "l.3"]},
    ]
    base = {
        "model_name": "org/Model-7B",
        "tokens_per_hash": 16,
        "blocks_per_file": 1,
        "tp_size": 4,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "rank": 3,
        "dtype": "bfloat16",
    }
    one_group = [{"tokens_per_block": 16, "layer_names": ["l.0", "l.1"]}]
    variants: list[dict[str, Any]] = [
        {"kv_cache_groups": one_group},
        {"kv_cache_groups": one_group, "parallel_agnostic": True},
        {"kv_cache_groups": one_group, "parallel_agnostic": True, "canonical_format": CANONICAL_FORMAT},
        {"kv_cache_groups": two_groups, "pp_size": 2, "rank": 5},
        {"kv_cache_groups": one_group, "parallel_agnostic": True, "replicated_layout": True},
        {"kv_cache_groups": [], "model_name": "test-model", "tp_size": 1, "dtype": "float16"},
    ]
    cases = []
    for v in variants:
        for hashes in (h64, h32):
            mapper = {**base, **v}
            cases.append({"mapper": mapper, "blocks": [[h, g] for h in hashes for g in (0, 2)]})
    return cases


def test_paths_match_vllms_file_mapper(vllm_python: str) -> None:
    cases = _cases()
    got = json.loads(oracle(vllm_python, "oracle_mapper.py", stdin=json.dumps(cases)))
    assert len(got) == len(cases)
    for case, theirs in zip(cases, got, strict=True):
        m = dict(case["mapper"])
        rank = 0 if m.get("parallel_agnostic") else m.pop("rank")
        m.pop("rank", None)
        fields = run_fields(**m)
        ns = namespace_for(fields)
        assert fields == theirs["fields"], case
        assert f"/root/{config_path(ns)}" == theirs["config"]
        ours = [f"/root/{block_path(namespace=ns, rank=rank, block_hash=h, group=g)}" for h, g in case["blocks"]]
        assert ours == theirs["paths"], case


def test_naming_matches_file_mapper_for_agnostic_and_rank_runs(vllm_python: str) -> None:
    group = KVGroup(tokens_per_block=16, layer_names=("a", "b"))
    h = hashlib.sha256(b"k").hexdigest()
    cases, ours = [], []
    for tp, rank, heads, mla in ((4, 3, 2, False), (2, 1, 8, False), (2, 1, 1, True), (1, 0, 8, False)):
        g = KVGroup(tokens_per_block=16, layer_names=group.layer_names, mla=mla)
        n = naming(
            model_name="org/m",
            tokens_per_hash=16,
            tp_size=tp,
            rank=rank,
            dtype="float16",
            groups=[g],
            num_kv_heads=heads,
            total_kv_heads=8 if not mla else 1,
        )
        mapper = {
            "model_name": "org/m",
            "tokens_per_hash": 16,
            "blocks_per_file": 1,
            "tp_size": tp,
            "pp_size": 1,
            "pcp_size": 1,
            "dcp_size": 1,
            "rank": rank,
            "dtype": "float16",
            "kv_cache_groups": [g.as_field()],
            "parallel_agnostic": n.parallel_agnostic,
            "canonical_format": CANONICAL_FORMAT if n.parallel_agnostic else None,
        }
        cases.append({"mapper": mapper, "blocks": [[h, 0]]})
        ours.append(f"/root/{n.block(h, 0)}")
    got = json.loads(oracle(vllm_python, "oracle_mapper.py", stdin=json.dumps(cases)))
    assert [g["paths"][0] for g in got] == ours
    assert [c["mapper"]["parallel_agnostic"] for c in cases] == [True, False, False, True]
    assert make_offload_key(bytes.fromhex(h), 2)[-4:] == (2).to_bytes(4, "big")
