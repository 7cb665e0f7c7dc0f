"""The key contract: FileMapper naming, the digest, the parallel-agnostic rule and the strict parser."""

from __future__ import annotations

import hashlib
import json

import pytest

from connector.protocol import (
    CANONICAL_FORMAT,
    InvalidKey,
    KVGroup,
    block_path,
    check_namespace_fields,
    config_path,
    fields_digest,
    is_parallel_agnostic,
    make_offload_key,
    namespace_for,
    naming,
    parse_block_key,
    parse_config_key,
    run_fields,
    split_offload_key,
)


def independent_digest(fields: dict[str, object]) -> str:
    """Recomputed here from the rule's text, not through the module under test."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def test_vllm_test_vector() -> None:
    # vLLM's own FileMapper test vector (DESIGN.md).
    fields = run_fields(
        model_name="test-model",
        tokens_per_hash=16,
        blocks_per_file=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        dtype="float16",
    )
    ns = namespace_for(fields)
    assert ns == "test-model_de3bba26cf36"
    path = block_path(namespace=ns, rank=3, block_hash=bytes.fromhex("0001020304050607"), group=2)
    assert f"/tmp/cache/{path}" == "/tmp/cache/test-model_de3bba26cf36_r3/000/10_g2/0001020304050607.bin"
    assert config_path(ns) == "test-model_de3bba26cf36/config.json"


@pytest.mark.parametrize(
    ("model", "agnostic", "canonical"),
    [("meta-llama/Llama-3.1-8B", True, CANONICAL_FORMAT), ("Qwen/Qwen3-32B", False, None), ("m", True, None)],
)
def test_worked_examples_digest(model: str, agnostic: bool, canonical: str | None) -> None:
    groups = [{"tokens_per_block": 16, "layer_names": [f"model.layers.{i}.self_attn" for i in range(4)]}]
    fields = run_fields(
        model_name=model,
        tokens_per_hash=16,
        blocks_per_file=1,
        tp_size=4,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        dtype="bfloat16",
        kv_cache_groups=groups,
        parallel_agnostic=agnostic,
        canonical_format=canonical,
    )
    expected = {
        "model_name": model,
        "tokens_per_hash": 16,
        "blocks_per_file": 1,
        "tp_size": 1 if agnostic else 4,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "dtype": "bfloat16",
        "kv_cache_groups": groups,
        "inference_engine": "vllm",
    }
    if not agnostic:
        expected["parallel_agnostic"] = False
    if canonical:
        expected["canonical_format"] = canonical
    assert fields == expected
    assert fields_digest(fields) == independent_digest(expected)
    assert namespace_for(fields) == model.replace("/", "_") + "_" + independent_digest(expected)
    check_namespace_fields(namespace_for(fields), fields)
    with pytest.raises(InvalidKey):
        check_namespace_fields(namespace_for(fields), {**fields, "dtype": "float16"})


def test_non_ascii_model_name_uses_json_ascii_escapes() -> None:
    fields = run_fields(
        model_name="modèle",
        tokens_per_hash=16,
        blocks_per_file=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        dtype="float16",
    )
    assert (
        fields_digest(fields)
        == hashlib.sha256(
            json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
        ).hexdigest()[:12]
    )


FULL = KVGroup(tokens_per_block=16, layer_names=("l0", "l1"))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"groups": [FULL], "num_kv_heads": 2, "total_kv_heads": 8, "tp_size": 4}, True),
        ({"groups": [FULL], "num_kv_heads": 8, "total_kv_heads": 8, "tp_size": 1}, True),
        ({"groups": [FULL, FULL], "num_kv_heads": 2, "total_kv_heads": 8, "tp_size": 4}, False),
        (
            {
                "groups": [KVGroup(16, ("l0",), full_attention=False)],
                "num_kv_heads": 2,
                "total_kv_heads": 8,
                "tp_size": 4,
            },
            False,
        ),
        ({"groups": [KVGroup(16, ("l0",), mla=True)], "num_kv_heads": 1, "total_kv_heads": 1, "tp_size": 1}, False),
        ({"groups": [FULL], "num_kv_heads": 2, "total_kv_heads": 8, "tp_size": 4, "pp_size": 2}, False),
        ({"groups": [FULL], "num_kv_heads": 2, "total_kv_heads": 8, "tp_size": 4, "pcp_size": 2}, False),
        ({"groups": [FULL], "num_kv_heads": 2, "total_kv_heads": 8, "tp_size": 4, "dcp_size": 2}, False),
        # 2 KV heads replicated over TP=8: every rank holds one whole head, not a shard.
        ({"groups": [FULL], "num_kv_heads": 1, "total_kv_heads": 2, "tp_size": 8}, False),
        ({"groups": [], "num_kv_heads": 1, "total_kv_heads": 1, "tp_size": 1}, False),
    ],
)
def test_parallel_agnostic_rule(kwargs: dict[str, object], expected: bool) -> None:
    assert is_parallel_agnostic(**kwargs) is expected  # type: ignore[arg-type]


def _paths(tp: int, *, groups: list[KVGroup], total_heads: int = 8) -> set[str]:
    out = set()
    for rank in range(tp):
        n = naming(
            model_name="org/m",
            tokens_per_hash=16,
            tp_size=tp,
            rank=rank,
            dtype="bfloat16",
            groups=groups,
            num_kv_heads=max(1, total_heads // tp),
            total_kv_heads=total_heads,
        )
        out.add(n.block(bytes(range(32)), 0))
    return out


def test_agnostic_paths_identical_across_tp() -> None:
    paths = [_paths(tp, groups=[FULL]) for tp in (1, 2, 4)]
    assert paths[0] == paths[1] == paths[2]
    assert len(paths[0]) == 1
    assert "_r0/" in next(iter(paths[0]))


def test_non_agnostic_paths_differ_across_tp() -> None:
    two = [FULL, KVGroup(16, ("l2",), full_attention=False)]
    p1, p2, p4 = (_paths(tp, groups=two) for tp in (1, 2, 4))
    assert len(p1) == 1 and len(p2) == 2 and len(p4) == 4
    assert not (p1 & p2) and not (p2 & p4) and not (p1 & p4)


def test_parse_roundtrip_and_offload_key() -> None:
    h = hashlib.sha256(b"x").digest()
    key = make_offload_key(h, 7)
    assert split_offload_key(key) == (h, 7)
    ns = "org_m_0123456789ab"
    path = block_path(namespace=ns, rank=5, block_hash=h, group=7)
    parsed = parse_block_key(path)
    assert (parsed.namespace, parsed.rank, parsed.group, parsed.block_hash) == (ns, 5, 7, h.hex())
    assert parsed.path == path
    assert parse_config_key(f"{ns}/config.json") == ns
    xx = bytes(range(16))  # xxhash-style 32 hex
    assert parse_block_key(block_path(namespace=ns, rank=0, block_hash=xx, group=0)).block_hash == xx.hex()


BAD_KEYS = [
    "",
    "../etc/passwd",
    "/abs/path.bin",
    "ns_0123456789ab_r0/abc/de_g0/../../x.bin",
    "ns_0123456789ab_r0//abc/de_g0/abcdef0123456789.bin",
    "ns_0123456789ab_r0\\abc\\de_g0\\abcdef0123456789.bin",
    "ns_0123456789ab_r0/abc/de_g0/abcdef0123456789.bin\x00",
    "ns_0123456789ab_r0/abc/de_g0/ABCDEF0123456789.bin",  # FileMapper emits lowercase hex
    "ns_0123456789ab_r0/abd/de_g0/abcdef0123456789.bin",  # prefix dirs disagree with the hash
    "ns_0123456789ab_r0/abc/de_g0/abcdef012345678.bin",  # odd length
    "ns_0123456789ab_r0/abc/de_g0/abcdefg123456789.bin",  # non-hex
    "ns_0123456789ab_r0/abc/de_g0/abcdef0123456789.txt",
    "ns_0123456789ab_r01/abc/de_g0/abcdef0123456789.bin",  # leading zero rank
    "ns_0123456789ab_r0/abc/de_g-1/abcdef0123456789.bin",
    "ns_0123456789ab_r0/abc/de_g99999999999/abcdef0123456789.bin",
    ".hidden_0123456789ab_r0/abc/de_g0/abcdef0123456789.bin",
    "ns_0123456789a_r0/abc/de_g0/abcdef0123456789.bin",  # 11-hex digest
    "ns_0123456789ab/abc/de_g0/abcdef0123456789.bin",  # no rank
    "ns_0123456789ab_r0/abc/de_g0/" + "ab" * 65 + ".bin",  # hash too long
    "a" * 600,
    "ns_0123456789ab_r0/abc/de_g0/abcdef0123456789.bin/more",
    "ns 0123456789ab_r0/abc/de_g0/abcdef0123456789.bin",
]


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_parser_rejects(bad: str) -> None:
    with pytest.raises(InvalidKey):
        parse_block_key(bad)
