"""Tokens and a gateway with auth on, shared by the security tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.api.middleware.principals import hash_token
from contract.keys import namespace_for
from tests.conftest import TEST_NS, agnostic_fields
from tests.gateway import Gateway

OTHER_NS = namespace_for(
    agnostic_fields(
        "other-org/other-model", dtype="float16", groups=[{"tokens_per_block": 16, "layer_names": ["layer.0"]}]
    )
)

TOKENS = {
    "read": "tok-read-5f1c",
    "write": "tok-write-91ab",
    "admin": "tok-admin-c0de",
    "other": "tok-other-ns-77aa",  # write, limited to OTHER_NS
    "scoped_admin": "tok-scoped-admin-33",  # admin, limited to TEST_NS
}


def tokens_json() -> str:
    entries = [
        {"name": "reader", "sha256": hash_token(TOKENS["read"]), "role": "read"},
        {"name": "writer", "sha256": hash_token(TOKENS["write"]), "role": "write"},
        {"name": "admin", "sha256": hash_token(TOKENS["admin"]), "role": "admin"},
        {"name": "other", "sha256": hash_token(TOKENS["other"]), "role": "write", "namespaces": [OTHER_NS]},
        {
            "name": "scoped-admin",
            "sha256": hash_token(TOKENS["scoped_admin"]),
            "role": "admin",
            "namespaces": [TEST_NS],
        },
    ]
    return json.dumps(entries)


def bearer(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


def start_secure(data: Path, **env: str) -> Gateway:
    return Gateway(data, env={"KVGATE_TOKENS": tokens_json(), **env}).start()


@pytest.fixture
def secure_gateway(tmp_path: Path) -> Iterator[Gateway]:
    gw = start_secure(tmp_path / "data")
    try:
        yield gw
    finally:
        gw.stop()
