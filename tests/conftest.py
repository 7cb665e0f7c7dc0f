from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.keys import block_path, namespace_for, run_fields
from tests.gateway import Gateway

pytest_plugins = ["tests.services"]  # session-wide moto S3 and PostgreSQL servers, started once on first use

QUICK = os.environ.get("KVGATE_QUICK") == "1"
"""The quick loop (scripts/check sets ``KVGATE_QUICK=1``): property tests run a fifth of their examples. The whole
suite (the README's test command, CI) runs every example."""


def examples(n: int) -> int:
    """A property test's ``max_examples``: ``n``, or a fifth of it (at least 50) in the quick loop."""
    return max(50, n // 5) if QUICK else n


WARNINGS_ARE_ERRORS_IN = frozenset({"unit", "inprocess", "examples"})
"""The folders of tests/ that run clean with warnings as errors: each of their tests runs under "error", then
pyproject.toml's named exceptions. A folder joins once it has been run whole that way (its services up)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    strict = pytest.mark.filterwarnings("error", *config.getini("filterwarnings"))  # the exceptions still ignored
    here = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(here).parts if item.path.is_relative_to(here) else ()
        if len(parts) >= 2 and parts[0] in WARNINGS_ARE_ERRORS_IN:
            # first among the item's marks, so a test's or a module's own filterwarnings still has the last word
            item.add_marker(strict, append=False)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    """A real gateway on the embedded default: filesystem + SQLite under tmp_path, loopback."""
    gw = Gateway(tmp_path / "data").start()
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as c:
        yield c


def agnostic_fields(
    model_name: str, *, dtype: str = "bfloat16", groups: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """FileMapper fields of a parallel-agnostic test run (one full-attention group unless told otherwise)."""
    return run_fields(
        model_name=model_name,
        tokens_per_hash=16,
        blocks_per_file=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        dtype=dtype,
        kv_cache_groups=[{"tokens_per_block": 16, "layer_names": ["layer.0"]}] if groups is None else groups,
        parallel_agnostic=True,
    )


TEST_NS = namespace_for(
    agnostic_fields(
        "test-org/test-model", dtype="bfloat16", groups=[{"tokens_per_block": 16, "layer_names": ["layer.0"]}]
    )
)


def key_for(i: int, *, namespace: str = TEST_NS, rank: int = 0, group: int = 0) -> str:
    """A valid block path whose hash is derived from ``i`` (sha256, 64 hex)."""
    return block_path(namespace=namespace, rank=rank, block_hash=hashlib.sha256(str(i).encode()).digest(), group=group)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def crc(data: bytes) -> str:
    """The checksum token kvgate records for ``data`` when its writer names no algorithm (CRC64NVME): what the
    ETag quotes, the PUT answer's ``digest``."""
    from app.storage.checksums import checksum_of

    return checksum_of(data).token


def token_as(tag: str, data: bytes) -> str:
    """``data``'s checksum token in the algorithm of ``tag`` (a checksum token, or an ETag that quotes one)."""
    from app.storage.checksums import checksum_of
    from contract.wire import parse_checksum_token

    return checksum_of(data, parse_checksum_token(tag.strip('"')).algorithm).token


def matches(tag: str, data: bytes) -> bool:
    """``data`` is what checksum token (or ETag) ``tag`` names, checked in the tag's own algorithm."""
    try:
        return token_as(tag, data) == tag.strip('"')
    except ValueError:
        return False


def crc_header(data: bytes) -> str:
    """``crc64nvme=<base64>`` of ``data``: the value of X-KVGate-Checksum (and of X-KVGate-Range-Checksum)."""
    from app.storage.checksums import checksum_of

    return checksum_of(data).header


def random_bytes(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The oracle venv's python (tests/vllm need it); CI sets KVGATE_VLLM_PYTHON, else they are skipped."""
    py = os.environ.get("KVGATE_VLLM_PYTHON")
    if not py:
        if os.environ.get("KVGATE_REQUIRE_VLLM"):
            pytest.fail("KVGATE_REQUIRE_VLLM is set but KVGATE_VLLM_PYTHON is not")
        pytest.skip("KVGATE_VLLM_PYTHON not set (build it with ../shared/vllm-oracle.sh)")
    return py
