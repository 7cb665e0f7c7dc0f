"""The vLLM tier over mutual TLS: vLLM 0.33's own tier factory builds KVGateTier with the TLS keys of its config;
rows round-trip byte for byte through an HTTPS gateway that requires client certificates, and a tier given a
CA that does not sign the gateway fails at construction instead of missing for ever after."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loopback.tls_pki import CA, TlsGateway, client_context
from tests.vllm.tier_harness import rows, run_driver

pytestmark = pytest.mark.vllm


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca, other = CA(), CA("another CA")
    d = tmp_path / "pki"
    server, node = ca.issue("kvgate", server=True).write(d, "server"), ca.issue("node-1").write(d, "node")
    return {
        "ca": ca.write(d / "ca.pem"),
        "other_ca": other.write(d / "other.pem"),
        "server_cert": server[0],
        "server_key": server[1],
        "node_cert": node[0],
        "node_key": node[1],
    }


@pytest.fixture
def mtls(pki: dict[str, Path], tmp_path: Path) -> Iterator[TlsGateway]:
    env = {
        "KVGATE_TLS_CERTFILE": str(pki["server_cert"]),
        "KVGATE_TLS_KEYFILE": str(pki["server_key"]),
        "KVGATE_TLS_CLIENT_CA": str(pki["ca"]),
        "KVGATE_TOKENS": json.dumps([{"name": "node-1", "cert_subject": "CN=node-1,O=kvgate-tests", "role": "admin"}]),
    }
    gw = TlsGateway(tmp_path / "data", ca=pki["ca"], ready_cert=(pki["node_cert"], pki["node_key"]), env=env)
    yield gw.start()
    gw.stop()


def test_factory_built_tier_round_trips_rows_over_mutual_tls(
    vllm_python: str, mtls: TlsGateway, pki: dict[str, Path], tmp_path: Path
) -> None:
    tls = {"ca_file": str(pki["ca"]), "cert_file": str(pki["node_cert"]), "key_file": str(pki["node_key"])}
    out = tmp_path / "out"
    report = run_driver(vllm_python, "roundtrip", out, url=mtls.url, data_root=mtls.data_dir / "blocks", tier_extra=tls)
    stored = rows(out, count=4)
    assert report["store"] == {"1001": {"success": True, "successful_keys": None, "bytes": 4 * 65536}}
    assert report["after"][0] == ["HIT"] * 4
    assert report["load"]["1003"]["success"] is True and report["load_equal"] == [True] * 4
    ctx = client_context(ca=pki["ca"], cert=(pki["node_cert"], pki["node_key"]))
    with httpx.Client(base_url=mtls.url, verify=ctx, timeout=10.0) as c:
        for i in (0, 3):
            assert c.get(f"/v1/blocks/{report['paths'][i]}").content == stored[i]


def test_tier_with_a_wrong_ca_fails_at_construction(
    vllm_python: str, mtls: TlsGateway, pki: dict[str, Path], tmp_path: Path
) -> None:
    tls = {"ca_file": str(pki["other_ca"]), "cert_file": str(pki["node_cert"]), "key_file": str(pki["node_key"])}
    with pytest.raises(AssertionError, match=r"GatewayTLSError: .*certificate verify failed"):
        run_driver(vllm_python, "roundtrip", tmp_path / "out", url=mtls.url, data_root=tmp_path, tier_extra=tls)


def test_standalone_connector_reads_the_tls_keys(vllm_python: str) -> None:
    """KVGateConnector's kv_connector_extra_config carries ca_file / cert_file / key_file into its client."""
    import subprocess

    from tests.gateway import REPO

    code = (
        "import json; import connector.vllm.connector; from connector.vllm.settings import ConnectorSettings; "
        "c = ConnectorSettings.parse({'url': 'https://gw:8750', 'ca_file': '/p/ca.pem', 'cert_file': '/p/n.crt', "
        "'key_file': '/p/n.key'}).client_config()\n"
        "print(json.dumps([c.base_url, c.ca_file, c.cert_file, c.key_file]))\n"
        "from connector.vllm.settings import SettingsError\n"
        "try:\n    ConnectorSettings.parse({'url': 'https://gw:8750', 'ca_fle': '/p/ca.pem'})\n"
        "except SettingsError as exc:\n    print(json.dumps(['refused', str(exc)]))"
    )
    out = subprocess.run(
        [vllm_python, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240, check=True
    ).stdout
    *_, keys, refused = out.strip().splitlines()
    assert json.loads(keys) == ["https://gw:8750", "/p/ca.pem", "/p/n.crt", "/p/n.key"]
    verdict, message = json.loads(refused)  # a misspelt TLS key fails at start-up, never a silent plain client
    assert verdict == "refused" and "'ca_fle'" in message and "ca_file" in message
