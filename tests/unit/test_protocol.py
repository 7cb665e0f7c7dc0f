"""The key contract: FileMapper naming, the digest, the parallel-agnostic rule and the strict parser."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import keys as protocol
from contract.keys import (
    CANONICAL_FORMAT,
    InvalidKey,
    KVGroup,
    block_path,
    check_block_paths,
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
from tests.conftest import examples


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


# The key grammar as one regex, written from FileMapper's text: the parser (which splits the path and caches heads)
# must agree with it on every string, valid or not.
_REFERENCE = re.compile(
    r"(?P<ns>[A-Za-z0-9_][A-Za-z0-9._-]{0,199}_[0-9a-f]{12})_r(?P<rank>0|[1-9][0-9]{0,5})"
    r"/(?P<d1>[0-9a-f]{3})/(?P<d2>[0-9a-f]{2})_g(?P<group>0|[1-9][0-9]{0,9})/(?P<hash>(?:[0-9a-f]{2}){8,64})\.bin"
)


def _reference(path: str) -> tuple[str, int, int, str] | None:
    m = _REFERENCE.fullmatch(path) if len(path) <= 512 else None
    if m is None or m["d1"] != m["hash"][:3] or m["d2"] != m["hash"][3:5] or int(m["group"]) >= 2**32:
        return None
    return m["ns"], int(m["rank"]), int(m["group"]), m["hash"]


_pieces = st.sampled_from(
    ["org_m_0123456789ab", "a.b-c_ffffffffffff", "m_0123456789a", "_r", "_r0", "_r12", "_r01", "/", "//", "abc",
     "ab", "de", "_g0", "_g7", "_g4294967296", "_g-1", ".bin", ".txt", "0123456789abcdef", "abcdef0123456789",
     "ABCDEF", "_", "x", "\x00", " ", "..", "0"]
)  # fmt: skip


def _valid_paths() -> st.SearchStrategy[str]:
    ns = st.sampled_from(["org_m_0123456789ab", "a.b-c_ffffffffffff", "x_r1_000000000000"])
    hashes = st.binary(min_size=8, max_size=32)
    ranks = st.integers(0, 999_999)
    groups = st.integers(0, 2**32 - 1)
    return st.builds(
        lambda n, r, h, g: block_path(namespace=n, rank=r, block_hash=h, group=g), ns, ranks, hashes, groups
    )


_FIELDS: dict[str, list[str]] = {  # a good value first, then bad ones at the edges of the grammar
    "ns": ["org_m_0123456789ab", "a_r0_0123456789ab", ".x_0123456789ab", "m_0123456789a", "m_0123456789aB", ""],
    "rank": ["7", "0", "999999", "01", "1234567", "-1", ""],
    "case": ["lower", "upper", "g"],
    "d1": ["ok", "abc", "short", "long"],
    "d2": ["ok", "de", "short", "long"],
    "group": ["9", "0", "4294967295", "4294967296", "00", "-1", "a", ""],
    "ext": [".bin", ".txt", "", ".bin/x", ".bin\x00"],
}


@st.composite
def _near_paths(draw: st.DrawFn, lengths: tuple[int, ...] = (0, 2, 14, 15, 16, 17, 18, 64, 126, 128, 129, 130)) -> str:
    """Paths shaped like keys with at most one field broken (at its edges: lengths, case, leading zeros, prefixes)."""
    broken = draw(st.sampled_from([None, *_FIELDS]))
    f = {name: draw(st.sampled_from(values)) if name == broken else values[0] for name, values in _FIELDS.items()}
    n = draw(st.sampled_from(lengths))
    digest = draw(st.text("0123456789abcdef", min_size=n, max_size=n))
    digest = {"lower": digest, "upper": digest.upper(), "g": digest + "g"}[f["case"]]
    d1 = {"ok": digest[:3], "abc": "abc", "short": digest[:2], "long": digest[:4]}[f["d1"]]
    d2 = {"ok": digest[3:5], "de": "de", "short": digest[3:4], "long": digest[3:6]}[f["d2"]]
    return f"{f['ns']}_r{f['rank']}/{d1}/{d2}_g{f['group']}/{digest}{f['ext']}"


@settings(max_examples=examples(1500), deadline=None)
@given(st.one_of(_valid_paths(), _near_paths(), st.lists(_pieces, max_size=12).map("".join)))
def test_parser_agrees_with_the_one_regex_grammar(path: str) -> None:
    expected = _reference(path)
    try:
        parsed = parse_block_key(path)
    except InvalidKey:
        assert expected is None, path
        return
    assert (parsed.namespace, parsed.rank, parsed.group, parsed.block_hash) == expected, path
    assert parsed.path == path  # a path that parses is its own canonical form (lookup relies on it)


def test_a_cached_head_does_not_admit_a_bad_tail() -> None:
    good = block_path(namespace="org_m_0123456789ab", rank=3, block_hash=bytes(range(16)), group=0)
    parse_block_key(good)  # caches the head
    head = good.split("/", 1)[0]
    for tail in ["abc/de_g0/abcdef0123456789.txt", "000/01_g0/000102.bin", "", "000/01_g0/" + "0" * 20 + ".bin"]:
        with pytest.raises(InvalidKey):
            parse_block_key(f"{head}/{tail}")


_any_path = st.one_of(_valid_paths(), _near_paths(), st.lists(_pieces, max_size=12).map("".join))


@settings(max_examples=examples(800), deadline=None)
@given(st.lists(st.one_of(_valid_paths(), _valid_paths(), _any_path), max_size=6))
def test_batch_check_accepts_exactly_what_the_parser_accepts(paths: list[str]) -> None:
    def parses(p: str) -> bool:
        try:
            parse_block_key(p)
        except InvalidKey:
            return False
        return True

    try:
        check_block_paths(paths)
        accepted = True
    except InvalidKey:
        accepted = False
    assert accepted == all(parses(p) for p in paths), paths


def test_batch_check_rejects_keys_that_hide_a_line_break() -> None:
    good = [block_path(namespace="org_m_0123456789ab", rank=0, block_hash=bytes([i]) * 8, group=0) for i in range(3)]
    check_block_paths(good)
    check_block_paths([])
    for bad in ([good[0] + "\n" + good[1]], [good[0], good[1] + "\n"], ["\n".join(good)], [good[0] + "\r"]):
        with pytest.raises(InvalidKey):
            check_block_paths(bad)


def _sha256_paths() -> st.SearchStrategy[str]:
    """sha256-hashed paths, with groups at the edges of the grammar (2**32 and up: not keys)."""
    ns = st.sampled_from(["org_m_0123456789ab", "a.b-c_ffffffffffff", "x_r1_000000000000"])
    return st.builds(
        lambda n, r, h, g: block_path(namespace=n, rank=r, block_hash=h, group=g),
        ns,
        st.integers(0, 999_999),
        st.binary(min_size=32, max_size=32),
        st.sampled_from([0, 1, 999_999_999, 1_000_000_000, 2**32 - 1, 2**32, 9_999_999_999, 10**10]),
    )


@settings(max_examples=examples(800), deadline=None)
@given(st.lists(st.one_of(_sha256_paths(), _near_paths(lengths=(62, 63, 64, 65, 66))), min_size=1, max_size=6))
def test_the_sha256_batch_regex_admits_only_block_paths(paths: list[str]) -> None:
    """check_block_paths' one-regex path (sha256 hashes: no per-key comparisons) accepts a batch only if the parser
    accepts every key in it; what it leaves goes the general way, which the test above holds to the parser."""
    joined = "\n".join(paths)
    if joined.count("\n") == len(paths) - 1 and protocol._SHA256_LINES_RE.fullmatch(joined + "\n"):
        for p in paths:
            parse_block_key(p)


def test_a_batch_of_sha256_keys_is_checked_by_one_regex(monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual batch never reaches the general check; one bad key in it sends it there (and is refused)."""
    keys = [block_path(namespace="org_m_0123456789ab", rank=1, block_hash=hashlib.sha256(bytes([i])).digest(), group=i)
            for i in range(50)]  # fmt: skip
    head, d1, d2g, name = keys[7].split("/")
    h = name.removesuffix(".bin")
    other = "0" if h[0] != "0" else "1"
    broken = [
        keys[0] + "\n" + keys[1],  # a line break inside a key
        keys[0] + keys[1],  # two keys run together
        f"{head}/{other}{d1[1:]}/{d2g}/{name}",  # the first directory is not the hash's first 3 digits
        f"{head}/{d1}/{other}{d2g[1:]}/{name}",  # the second is not its next 2
        f"{head}/{d1}/{d2g.replace('_g7', '_g07')}/{name}",  # a leading zero
        f"{head}/{d1}/{d2g.replace('_g7', f'_g{2**32}')}/{name}",  # a group past 32 bits
        f"{head}/{d1}/{d2g}/{h[:-1]}.bin",  # an odd number of hex digits
        f"{head}/{d1}/{d2g}/{h}0.bin",
        f"{head}/{d1}/{d2g}/{h.upper()}.bin",
    ]
    check_block_paths([keys[7].replace(f"/{h}.", f"/{h}00.")])  # 66 hex digits: a key, the general way
    monkeypatch.setattr(protocol, "_LINES_RE", re.compile("(?!)"))  # the general way now refuses every batch
    check_block_paths(keys)  # so it was not taken
    for bad in broken:
        with pytest.raises(InvalidKey):
            check_block_paths([*keys[:7], bad, *keys[8:]])
    monkeypatch.setattr(protocol, "_SHA256_LINES_RE", re.compile("(?!)"))
    with pytest.raises(InvalidKey):
        check_block_paths(keys)
