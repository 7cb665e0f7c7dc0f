"""schemathesis (its CLI, as a user runs it) against real gateways, the spec at /openapi.json as the contract.

Every check schemathesis has (``--checks all``: server errors, statuses, content types, response schemas and
headers, negative data rejected, positive data accepted, missing headers, unsupported methods and their ``Allow``,
use after free, resource availability, ignored auth, object-level authorization), positive and negative cases, and
every phase: the spec's examples, its coverage cases, fuzzing, and the stateful phase that follows the spec's links
(a stored block to its GET/HEAD/DELETE, a stored config to its GET). Four configurations: auth off, an admin token,
a read-only token, and no token where tokens are on. Each must report no failure and no error. Where a check's idea
of a valid request is wrong for kvgate, tests/security/schemathesis.toml says so for that operation and why; the
hooks in tests/security/schemathesis_hooks.py make positive PUTs true to what no schema can state (checksums of the
body, a namespace named by its fields). Bounded: :data:`EXAMPLES` cases per operation and phase, a fixed seed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import key_for, random_bytes
from tests.gateway import REPO, Gateway
from tests.security.conftest import TOKENS, bearer, start_secure

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "schemathesis.toml"
HOOKS = "tests.security.schemathesis_hooks"
EXAMPLES = 20
"""Cases per operation in each generating phase (the stateful phase runs its own scenarios)."""
SEED = 1
PHASES = ("examples", "coverage", "fuzzing", "stateful")
EVENTS = {"KVGATE_EVENTS_ENABLED": "true"}  # GET /v1/events answers (a stream) instead of its 404
CANARY = key_for(424242)
CANARY_BYTES = random_bytes(4096, 42)


def schemathesis(url: str, *, token: str | None, workdir: Path) -> dict[str, Any]:
    """Run ``st run`` with every check, mode and phase against ``url``; its JSON report (the exit code in it)."""
    config = workdir / "schemathesis.toml"
    text = CONFIG.read_text()
    if token is not None:  # the spec's bearer scheme, so that ignored_auth knows what to leave out
        text += f'\n[auth.openapi.bearer]\nbearer = "{token}"\n'
    config.write_text(text)
    report = workdir / "report.json"
    argv = [
        str(Path(sys.executable).with_name("st")),
        "--config-file",
        str(config),
        "run",
        f"{url}/openapi.json",
        "--checks=all",
        "--mode=all",
        f"--phases={','.join(PHASES)}",
        f"--max-examples={EXAMPLES}",
        f"--seed={SEED}",
        "--workers=1",
        "--request-timeout=20",
        "--generation-database=none",
        "--no-color",
        "--report=json",
        f"--report-json-path={report}",
    ]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "SCHEMATHESIS_HOOKS": HOOKS, "HOME": str(workdir)}
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert report.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    result: dict[str, Any] = json.loads(report.read_text())
    result["output"] = done.stdout[-6000:] + done.stderr[-2000:]
    result["returncode"] = done.returncode
    return result


def assert_green(result: dict[str, Any], *, name: str) -> None:
    cases = result["test_cases"]
    print(f"schemathesis {name}: {cases['generated']} cases, {result['running_time']:.0f} s, seed {result['seed']}")
    assert result["returncode"] == 0 and result["exit_code"] == 0, result["output"]
    assert result["failures"] == [] and result["errors"] == [], result["output"]
    assert result["complete"] and result["operations"]["tested"] == result["operations"]["total"] >= 15, result
    assert {phase: v["status"] for phase, v in result["phases"].items()} == dict.fromkeys(PHASES, "success"), result
    assert cases["generated"] >= 300, result["output"]


@pytest.fixture(scope="module")
def open_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway(tmp_path_factory.mktemp("st-open") / "data", env=EVENTS).start()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def secure_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = start_secure(tmp_path_factory.mktemp("st-secure") / "data", **EVENTS)
    with httpx.Client(base_url=gw.url, headers=bearer("admin")) as c:
        assert c.put(f"/v1/blocks/{CANARY}", content=CANARY_BYTES).status_code == 201
    yield gw
    gw.stop()


def test_schemathesis_auth_off(open_gateway: Gateway, tmp_path: Path) -> None:
    assert_green(schemathesis(open_gateway.url, token=None, workdir=tmp_path), name="auth off")


@pytest.mark.parametrize("who", ["read", None], ids=["read-token", "no-token"])
def test_schemathesis_without_write_rights(secure_gateway: Gateway, tmp_path: Path, who: str | None) -> None:
    """A read-only token and no token: every case that would change something is refused, and the canary block
    stored before is intact after."""
    token = None if who is None else TOKENS[who]
    assert_green(schemathesis(secure_gateway.url, token=token, workdir=tmp_path), name=f"{who or 'no'} token")
    with httpx.Client(base_url=secure_gateway.url, headers=bearer("admin")) as c:
        assert c.get(f"/v1/blocks/{CANARY}").content == CANARY_BYTES


def test_schemathesis_admin_token(secure_gateway: Gateway, tmp_path: Path) -> None:
    """Last on this gateway: the admin may delete and purge what the runs before stored."""
    assert_green(schemathesis(secure_gateway.url, token=TOKENS["admin"], workdir=tmp_path), name="admin token")
