"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, PyPI ai-dynamo-runtime 1.6.x, in a venv of
its own: KVGATE_DYNAMO_PYTHON) run as its users run it: an HTTP service that takes ``POST /register {instance_id,
endpoint, replay_endpoint, model_name, block_size}``, subscribes to that ZMQ endpoint, and answers ``POST /query
{token_ids, model_name}`` with each instance's longest cached prefix, in tokens."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway import free_port


def dynamo_python() -> str:
    """The Dynamo venv's python; skipped without KVGATE_DYNAMO_PYTHON unless KVGATE_REQUIRE_DYNAMO is set (CI)."""
    py = os.environ.get("KVGATE_DYNAMO_PYTHON")
    if not py:
        if os.environ.get("KVGATE_REQUIRE_DYNAMO"):
            pytest.fail("KVGATE_REQUIRE_DYNAMO is set but KVGATE_DYNAMO_PYTHON is not")
        pytest.skip("KVGATE_DYNAMO_PYTHON not set (see .ci/run: a venv with ai-dynamo-runtime 1.6.x)")
    return py


class DynamoIndexer:
    """One ``python -m dynamo.indexer`` process on a loopback port, its log in ``log_path``."""

    def __init__(self, python: str, *, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self._log = log_path.open("wb")
        env = {**os.environ, "RUST_LOG": "info"}
        argv = [python, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"]
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.http.get("/workers").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"dynamo.indexer did not start: {self.log()[-3000:]}")
            time.sleep(0.1)

    def register(self, *, instance_id: int, endpoint: str, replay_endpoint: str, model: str, block_size: int) -> None:
        body = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "model_name": model,
            "block_size": block_size,
        }
        resp = self.http.post("/register", json=body)
        assert resp.status_code in (200, 201), resp.text

    def matched_tokens(self, *, model: str, token_ids: Sequence[int], instance_id: int) -> int:
        """The instance's longest cached prefix of ``token_ids`` for ``model``, in tokens (every tier)."""
        resp = self.http.post("/query", json={"token_ids": list(token_ids), "model_name": model})
        assert resp.status_code == 200, resp.text
        instances: dict[str, Any] = resp.json().get("instances", {})
        matched: int = instances.get(str(instance_id), {}).get("longest_matched", 0)
        return matched

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.http.close()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._log.close()
