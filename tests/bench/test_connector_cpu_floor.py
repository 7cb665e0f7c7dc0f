"""The connector CPU benchmark's floor client (benchmarks/connector/cpu.py) does a connector's store: its PUTs carry
the connector's checksum and land, byte for byte, and a PUT the gateway refuses fails the floor's round instead of
being counted as stored. Its figure is only a floor if it does the same work."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from benchmarks.connector.cpu import FloorClient
from connector.http.checksums import checksum
from contract.wire import CHECKSUM_HEADER
from tests.conftest import key_for, random_bytes
from tests.gateway import Gateway


def test_floor_client_stores_every_block_with_its_checksum(gateway: Gateway) -> None:
    blob = random_bytes(300_000, seed=1)
    keys = [key_for(7_000 + i) for i in range(10)]
    floor = FloorClient(gateway.url, connections=3)
    try:
        floor.store(keys, blob)
    finally:
        floor.close()
    for key in keys:
        got = httpx.get(f"{gateway.url}/v1/blocks/{key}", timeout=10.0)
        assert got.status_code == 200
        assert hashlib.sha256(got.content).digest() == hashlib.sha256(blob).digest()
        assert got.headers[CHECKSUM_HEADER] == checksum(blob).header


def test_floor_client_fails_on_a_refused_store(gateway: Gateway) -> None:
    """A PUT the gateway refuses (a key that does not parse: 400) fails the floor's store, from its thread."""
    floor = FloorClient(gateway.url, connections=2)
    try:
        with pytest.raises(AssertionError, match="400"):
            floor.store([key_for(7_100), "ns/not-a-block-key.bin"], random_bytes(4096, seed=2))
    finally:
        floor.close()
