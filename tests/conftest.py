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
