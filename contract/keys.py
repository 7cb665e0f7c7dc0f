"""The key contract between vLLM nodes and the gateway. Standard library only: both halves import it.

Keys are the relative paths that vLLM 0.33's ``FileMapper`` produces::

    <safe_model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<blockhash>.bin     a block
    <safe_model>_<digest>/config.json                                    the run's fields

``digest`` is the first 12 hex characters of sha256 over the compact, key-sorted JSON of the run's fields.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DIGEST_LEN = 12
CONFIG_FILENAME = "config.json"
CANONICAL_FORMAT = "kvgate-v1-hnd"
"""Byte format id of kvgate's head-outermost canonical layout; it takes part in the namespace digest."""

MAX_KEY_LEN = 512

# Header names shared by the gateway and its clients: connector/wire.py owns them and the values' grammar.

_NS = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}_[0-9a-f]{12}"
# A block path is matched in two pieces at its first "/" (a namespace has none): the head ``<ns>_r<rank>`` (its
# backtracking over the model name is most of a match's cost, and one run's keys share a handful of heads, so they
# are cached) and the tail ``<hhh>/<hh>_g<group>/<hash>.bin`` (no backtracking).
_HEAD_RE = re.compile(rf"(?P<namespace>{_NS})_r(?P<rank>0|[1-9][0-9]{{0,5}})")
_TAIL_RE = re.compile(  # the hash's even length is checked apart: a repeated group costs the match 2x
    r"(?P<d1>[0-9a-f]{3})/(?P<d2>[0-9a-f]{2})_g(?P<group>0|[1-9][0-9]{0,9})/(?P<hash>[0-9a-f]{16,128})\.bin"
)
_LINES_RE = re.compile(  # the whole grammar, a key a line: a batch of keys in one pass (check_block_paths)
    rf"^{_NS}_r(?:0|[1-9][0-9]{{0,5}})/([0-9a-f]{{3}})/([0-9a-f]{{2}})_g(0|[1-9][0-9]{{0,9}})/([0-9a-f]{{16,128}})\.bin$",
    re.MULTILINE,
)
_SHA256_LINES_RE = re.compile(  # the usual batch, every check in the regex: checked with no loop over the keys
    # sha256 block hashes (64 hex: even, and the directory prefixes by back-reference) and groups under 10**9
    rf"(?:{_NS}_r(?:0|[1-9][0-9]{{0,5}})/([0-9a-f]{{3}})/([0-9a-f]{{2}})_g(?:0|[1-9][0-9]{{0,8}})/\1\2[0-9a-f]{{59}}\.bin\n)++"
)
_GROUP_BELOW_2_32 = (  # 0 to 4294967295, digit by digit: a pattern has no numeric bound
    "0|[1-9][0-9]{0,8}|[1-3][0-9]{9}|4[01][0-9]{8}|42[0-8][0-9]{7}|429[0-3][0-9]{6}|4294[0-8][0-9]{5}"
    "|42949[0-5][0-9]{4}|429496[0-6][0-9]{3}|4294967[01][0-9]{2}|42949672[0-8][0-9]|429496729[0-5]"
)
BLOCK_KEY_PATTERN = (
    rf"^{_NS}_r(?:0|[1-9][0-9]{{0,5}})/([0-9a-f]{{3}})/([0-9a-f]{{2}})_g(?:{_GROUP_BELOW_2_32})/"
    r"\1\2[0-9a-f](?:[0-9a-f]{2}){5,61}\.bin$"
)
"""The block key grammar as one regex that JSON Schema (ECMA-262) and Python read alike, for the OpenAPI spec: the
directory prefixes by back-reference, the hash of even length 16-128, the group below 2**32. Looser than
:func:`parse_block_key` only in the length (:data:`MAX_KEY_LEN`, the schema's ``maxLength``)."""
NAMESPACE_PATTERN = f"^{_NS}$"
"""A namespace (``<safe_model>_<digest>``), as :func:`parse_namespace` takes it."""
_HEADS: dict[str, tuple[str, int]] = {}
_MAX_HEADS = 4096
_CONFIG_RE = re.compile(rf"(?P<namespace>{_NS})/config\.json")
_NAMESPACE_RE = re.compile(_NS)


class InvalidKey(ValueError):
    """A path that is not a kvgate key. Raised before anything touches storage."""


@dataclass(frozen=True, slots=True)
class BlockKey:
    """A parsed block path."""

    namespace: str
    rank: int
    group: int
    block_hash: str

    @property
    def path(self) -> str:
        return block_path(namespace=self.namespace, rank=self.rank, block_hash=self.block_hash, group=self.group)


def parse_block_key(path: str) -> BlockKey:
    """Parse a block path strictly; anything that vLLM's FileMapper cannot produce is an ``InvalidKey``. A path
    that parses is its own canonical form: ``parse_block_key(p).path == p``."""
    if len(path) > MAX_KEY_LEN:
        raise InvalidKey(f"key longer than {MAX_KEY_LEN} characters")
    head, _, tail = path.partition("/")
    ns_rank = _parse_head(head, path)
    m = _TAIL_RE.fullmatch(tail)
    if m is None or len(m["hash"]) % 2:
        raise InvalidKey(f"not a block key: {path[:120]!r}")
    block_hash = m["hash"]
    if m["d1"] != block_hash[:3] or m["d2"] != block_hash[3:5]:
        raise InvalidKey("directory prefix does not match the block hash")
    group = int(m["group"])
    if group >= 2**32:
        raise InvalidKey("group index out of range")
    return BlockKey(namespace=ns_rank[0], rank=ns_rank[1], group=group, block_hash=block_hash)


def _parse_head(head: str, path: str) -> tuple[str, int]:
    """``(namespace, rank)`` of a block path's first segment ``<ns>_r<rank>`` (remembered: a deployment has few)."""
    ns_rank = _HEADS.get(head)
    if ns_rank is None:
        h = _HEAD_RE.fullmatch(head)
        if h is None:
            raise InvalidKey(f"not a block key: {path[:120]!r}")
        ns_rank = (h["namespace"], int(h["rank"]))
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[head] = ns_rank
    return ns_rank


def block_namespace(path: str) -> str:
    """The namespace of a block path, read from its first segment alone (the rest is not checked: for a path known
    to be a block key, such as one the metadata cache holds); InvalidKey when that segment is not ``<ns>_r<rank>``."""
    return _parse_head(path.partition("/")[0], path)[0]


def check_block_paths(paths: Sequence[str]) -> None:
    """Raise ``InvalidKey`` unless every path is a block path (``parse_block_key`` would accept each): one regex pass
    over the batch, a few comparisons a key; on a failure the first bad path is parsed alone for its message. A
    batch of keys with sha256 hashes (64 hex digits, as vLLM's default block hash gives) is first tried against a regex
    that checks everything itself, with no per-key comparisons (faster); a batch it does not accept goes the general
    way."""
    joined = "\n".join(paths)
    ok = joined.count("\n") == len(paths) - 1 if paths else True
    if ok and paths and _SHA256_LINES_RE.fullmatch(joined + "\n") is not None:
        return  # every key a block path whose hash is a sha256 (their lengths are then well under MAX_KEY_LEN)
    if ok and paths and max(map(len, paths)) > MAX_KEY_LEN:
        ok = False
    if ok:
        found = _LINES_RE.findall(joined) if paths else []
        ok = len(found) == len(paths)
        for d1, d2, group, block_hash in found if ok else ():
            if d1 != block_hash[:3] or d2 != block_hash[3:5] or len(block_hash) % 2 or int(group) >= 2**32:
                ok = False
                break
    if not ok:
        for path in paths:
            parse_block_key(path)
        raise InvalidKey("not a batch of block keys")  # unreachable while the two checks agree (tests hold them)


def parse_namespace(name: str) -> str:
    if not _NAMESPACE_RE.fullmatch(name):
        raise InvalidKey(f"not a namespace: {name[:120]!r}")
    return name


def parse_config_key(path: str) -> str:
    """The namespace of a ``<ns>/config.json`` path."""
    m = _CONFIG_RE.fullmatch(path)
    if m is None:
        raise InvalidKey(f"not a config key: {path[:120]!r}")
    return m["namespace"]


def block_path(*, namespace: str, rank: int, block_hash: str | bytes, group: int) -> str:
    """``<ns>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``, exactly as FileMapper.get_file_name builds it."""
    hex_hash = block_hash.hex() if isinstance(block_hash, bytes) else block_hash
    return f"{namespace}_r{rank}/{hex_hash[:3]}/{hex_hash[3:5]}_g{group}/{hex_hash}.bin"


def config_path(namespace: str) -> str:
    return f"{namespace}/{CONFIG_FILENAME}"


def split_offload_key(key: bytes) -> tuple[bytes, int]:
    """vLLM's offload key is the block hash followed by the group index as 4 big-endian bytes."""
    if len(key) < 5:
        raise InvalidKey("offload key too short")
    return key[:-4], int.from_bytes(key[-4:], "big")


def make_offload_key(block_hash: bytes, group: int) -> bytes:
    return block_hash + group.to_bytes(4, "big")


# --- the run's fields and the namespace digest ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV-cache group of the model, as far as naming and the parallel-agnostic rule need it."""

    tokens_per_block: int
    layer_names: tuple[str, ...]
    full_attention: bool = True
    mla: bool = False

    def as_field(self) -> dict[str, Any]:
        return {"tokens_per_block": self.tokens_per_block, "layer_names": list(self.layer_names)}


def is_parallel_agnostic(
    *,
    groups: Sequence[KVGroup],
    num_kv_heads: int,
    total_kv_heads: int,
    tp_size: int,
    pp_size: int = 1,
    pcp_size: int = 1,
    dcp_size: int = 1,
) -> bool:
    """True when a block's bytes can be named independently of the parallel layout.

    Exactly one KV group, full attention, not MLA, KV heads really sharded over TP (not replicated), and no
    pipeline or context parallelism.
    """
    if len(groups) != 1:
        return False
    group = groups[0]
    if not group.full_attention or group.mla:
        return False
    if num_kv_heads * tp_size != total_kv_heads:
        return False
    return pp_size == pcp_size == dcp_size == 1


def run_fields(
    *,
    model_name: str,
    tokens_per_hash: int,
    blocks_per_file: int,
    tp_size: int,
    pp_size: int,
    pcp_size: int,
    dcp_size: int,
    dtype: str,
    kv_cache_groups: Sequence[KVGroup | Mapping[str, Any]] = (),
    inference_engine: str = "vllm",
    parallel_agnostic: bool = False,
    replicated_layout: bool = False,
    canonical_format: str | None = None,
    block_bytes: int | None = None,
    kv_layout: str | None = None,
) -> dict[str, Any]:
    """The fields that name a run, as FileMapper hashes them (tp/pp/pcp/dcp forced to 1 when agnostic).

    ``block_bytes`` (bytes of one whole canonical block) goes with ``canonical_format``, so the gateway can refuse
    a PUT of another size; ``kv_layout`` is the id of a page layout kvgate does not certify (stored as it is).
    Each is added only when given, so the fields of existing namespaces keep their digests.
    """
    if parallel_agnostic:
        tp_size = pp_size = pcp_size = dcp_size = 1
    fields: dict[str, Any] = {
        "model_name": model_name,
        "tokens_per_hash": tokens_per_hash,
        "blocks_per_file": blocks_per_file,
        "tp_size": tp_size,
        "pp_size": pp_size,
        "pcp_size": pcp_size,
        "dcp_size": dcp_size,
        "dtype": str(dtype),
        "kv_cache_groups": [g.as_field() if isinstance(g, KVGroup) else dict(g) for g in kv_cache_groups],
        "inference_engine": inference_engine,
    }
    if not parallel_agnostic:
        fields["parallel_agnostic"] = False
    if replicated_layout:
        fields["replicated_layout"] = True
    if canonical_format is not None:
        fields["canonical_format"] = canonical_format
        if block_bytes is not None:
            fields["block_bytes"] = block_bytes
    if kv_layout is not None:
        fields["kv_layout"] = kv_layout
    return fields


def fields_digest(fields: Mapping[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:DIGEST_LEN]


def namespace_for(fields: Mapping[str, Any]) -> str:
    """``<safe_model>_<digest>``: the directory FileMapper names ``base_path`` (without the root)."""
    return f"{str(fields['model_name']).replace('/', '_')}_{fields_digest(fields)}"


def check_namespace_fields(namespace: str, fields: Mapping[str, Any]) -> None:
    """Raise ``InvalidKey`` unless ``fields`` hash to ``namespace``."""
    expected = namespace_for(fields)
    if expected != namespace:
        raise InvalidKey(f"fields hash to {expected!r}, not {namespace!r}")


@dataclass(frozen=True, slots=True)
class RunNaming:
    """Everything a worker needs to name its blocks: the namespace and the rank that goes into paths."""

    namespace: str
    rank: int
    fields: Mapping[str, Any]
    parallel_agnostic: bool

    def block(self, block_hash: str | bytes, group: int = 0) -> str:
        return block_path(namespace=self.namespace, rank=self.rank, block_hash=block_hash, group=group)

    @property
    def config(self) -> str:
        return config_path(self.namespace)


def naming(
    *,
    model_name: str,
    tokens_per_hash: int,
    tp_size: int,
    rank: int,
    dtype: str,
    groups: Sequence[KVGroup],
    num_kv_heads: int,
    total_kv_heads: int,
    pp_size: int = 1,
    pcp_size: int = 1,
    dcp_size: int = 1,
    blocks_per_file: int = 1,
    inference_engine: str = "vllm",
    canonical_format: str | None = CANONICAL_FORMAT,
    block_bytes: int | None = None,
    kv_layout: str | None = None,
) -> RunNaming:
    """Name a run: agnostic runs use the canonical format, rank 0 and tp = 1; others keep their rank.

    ``kv_layout`` (an uncertified page layout's id) makes the run per-rank, named by that layout; ``block_bytes``
    is the whole canonical block's size, recorded with the canonical format.
    """
    agnostic = kv_layout is None and is_parallel_agnostic(
        groups=groups,
        num_kv_heads=num_kv_heads,
        total_kv_heads=total_kv_heads,
        tp_size=tp_size,
        pp_size=pp_size,
        pcp_size=pcp_size,
        dcp_size=dcp_size,
    )
    fields = run_fields(
        model_name=model_name,
        tokens_per_hash=tokens_per_hash,
        blocks_per_file=blocks_per_file,
        tp_size=tp_size,
        pp_size=pp_size,
        pcp_size=pcp_size,
        dcp_size=dcp_size,
        dtype=dtype,
        kv_cache_groups=groups,
        inference_engine=inference_engine,
        parallel_agnostic=agnostic,
        canonical_format=canonical_format if agnostic else None,
        block_bytes=block_bytes if agnostic else None,
        kv_layout=kv_layout,
    )
    return RunNaming(
        namespace=namespace_for(fields), rank=0 if agnostic else rank, fields=fields, parallel_agnostic=agnostic
    )
