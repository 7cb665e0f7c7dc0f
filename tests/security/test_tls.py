"""HTTPS and mutual TLS against a real gateway process, with certificates made by the test: curl and the
connector's client round-trip blocks byte for byte; every way a handshake must fail does, with its own error."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.api.middleware.principals import hash_token
from connector.http.client import BlockClient, ClientConfig, GatewayTLSError
from loopback.tls_pki import CA, DAY, NOW, TlsGateway
from tests.conftest import key_for, random_bytes
from tests.gateway import Gateway

ADMIN_TOKEN = "tok-tls-admin-41"


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path
    other_ca: Path
    server: tuple[Path, Path]
    expired_server: tuple[Path, Path]
    node: tuple[Path, Path]  # client: CN=node-1 (admin by subject)
    stranger: tuple[Path, Path]  # client: same CA, names no principal
    rogue: tuple[Path, Path]  # client: CN=node-1, from another CA
    expired_node: tuple[Path, Path]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = CA(), CA("another CA")
    return Pki(
        dir=d,
        ca=ca.write(d / "ca.pem"),
        other_ca=other.write(d / "other-ca.pem"),
        server=ca.issue("kvgate", server=True).write(d, "server"),
        expired_server=ca.issue("kvgate", server=True, not_after=NOW - DAY).write(d, "expired-server"),
        node=ca.issue("node-1").write(d, "node"),
        stranger=ca.issue("stranger").write(d, "stranger"),
        rogue=other.issue("node-1").write(d, "rogue"),
        expired_node=ca.issue("node-1", not_before=NOW - 3 * DAY, not_after=NOW - DAY).write(d, "expired-node"),
    )


def principals() -> str:
    return json.dumps(
        [
            {"name": "node-1", "cert_subject": "CN=node-1,O=kvgate-tests", "role": "admin"},
            {"name": "ops", "sha256": hash_token(ADMIN_TOKEN), "role": "admin"},
        ]
    )


def tls_env(pki: Pki, *, server: tuple[Path, Path] | None = None, **extra: str) -> dict[str, str]:
    cert, key = server or pki.server
    return {"KVGATE_TLS_CERTFILE": str(cert), "KVGATE_TLS_KEYFILE": str(key), **extra}


@pytest.fixture(scope="module")
def mtls(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsGateway]:
    """Client certificates required, from pki.ca; node-1's certificate is an admin principal."""
    env = tls_env(pki, KVGATE_TLS_CLIENT_CA=str(pki.ca), KVGATE_TOKENS=principals())
    gw = TlsGateway(tmp_path_factory.mktemp("mtls") / "data", ca=pki.ca, ready_cert=pki.node, env=env).start()
    yield gw
    gw.stop()


def curl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """curl, printing the HTTP status; its exit code tells the TLS failures apart (35 handshake, 56 receive,
    52 empty reply, 58 local certificate, 60 peer certificate)."""
    argv = ["curl", "-sS", "--max-time", "20", "-o", "/dev/null", "-w", "%{http_code}", *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def client_for(url: str, *, ca: Path, cert: tuple[Path, Path] | None = None, check: bool = True) -> BlockClient:
    return BlockClient(
        ClientConfig(
            base_url=url,
            ca_file=str(ca),
            cert_file=str(cert[0]) if cert else None,
            key_file=str(cert[1]) if cert else None,
            retries=0,
            check_tls_on_start=check,
        )
    )


def test_curl_round_trip_over_mutual_tls(mtls: TlsGateway, pki: Pki, tmp_path: Path) -> None:
    key, blob = key_for(101), random_bytes(3 * 1024 * 1024 + 5, seed=101)
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(blob)
    tls = ("--cacert", pki.ca, "--cert", pki.node[0], "--key", pki.node[1])
    put = curl(*tls, "-X", "PUT", "--data-binary", f"@{src}", f"{mtls.url}/v1/blocks/{key}")
    assert (put.returncode, put.stdout) == (0, "201"), put.stderr
    argv = ["curl", "-sS", "--fail", *map(str, tls), "-o", str(dst), f"{mtls.url}/v1/blocks/{key}"]
    subprocess.run(argv, check=True, timeout=60)
    assert dst.read_bytes() == blob
    # the same bytes through the connector's client, which presents the same certificate
    with client_for(mtls.url, ca=pki.ca, cert=pki.node) as bc:
        assert bc.run(bc.get(key)) == blob


def test_connector_client_round_trip_over_mutual_tls(mtls: TlsGateway, pki: Pki) -> None:
    keys = [key_for(200 + i) for i in range(4)]
    blobs = [random_bytes(1024 * 1024 + i, seed=200 + i) for i in range(4)]
    with client_for(mtls.url, ca=pki.ca, cert=pki.node) as bc:
        for k, b in zip(keys, blobs, strict=True):
            assert bc.run(bc.put(k, memoryview(b)))
        prefix, _slots = bc.run(bc.lookup([*keys, key_for(299)]))
        assert prefix == 4
        assert [bc.run(bc.get(k)) for k in keys] == blobs
        assert bc.run(bc.get(keys[1], byte_range=(10, 70_000))) == blobs[1][10:70_000]
        into = bytearray(len(blobs[2]))  # the connector's load: straight into a buffer (TLS records in pieces)
        assert bc.run(bc.get_into(keys[2], memoryview(into))) and into == blobs[2]


def test_server_certificate_from_a_wrong_ca_is_refused(mtls: TlsGateway, pki: Pki) -> None:
    r = curl("--cacert", pki.other_ca, "--cert", pki.node[0], "--key", pki.node[1], f"{mtls.url}/healthz")
    assert r.returncode == 60 and "certificate" in r.stderr, r
    with pytest.raises(GatewayTLSError, match="certificate verify failed"):
        client_for(mtls.url, ca=pki.other_ca, cert=pki.node)
    # without the start-up check, the first store says the same (the PUT goes on the lean pool: connector/http/http1.py)
    with client_for(mtls.url, ca=pki.other_ca, cert=pki.node, check=False) as bc:
        with pytest.raises(GatewayTLSError, match="certificate verify failed"):
            bc.run(bc.put(key_for(300), b"x" * 1000))
        assert bc._lean is not None


def test_expired_server_certificate_is_refused(pki: Pki, tmp_path: Path) -> None:
    env = tls_env(pki, server=pki.expired_server)
    gw = TlsGateway(tmp_path / "data", ca=pki.ca, ready_verify=False, env=env).start()
    try:
        r = curl("--cacert", pki.ca, f"{gw.url}/healthz")
        assert r.returncode == 60 and "expired" in r.stderr, r
        with pytest.raises(GatewayTLSError, match="expired"):
            client_for(gw.url, ca=pki.ca)
    finally:
        gw.stop()


@pytest.mark.parametrize("who", ["rogue", "expired_node", "none"])
def test_bad_or_missing_client_certificate_is_refused(mtls: TlsGateway, pki: Pki, who: str) -> None:
    """A client certificate from another CA, an expired one, or none at all while one is required: the gateway ends
    the connection after the handshake without an HTTP answer (uvloop drops the TLS alert, so curl reports an empty
    reply or a reset), and the connector's client fails at construction, naming the certificate."""
    cert: tuple[Path, Path] | None = getattr(pki, who) if who != "none" else None
    args: list[str | Path] = ["--cacert", pki.ca]
    if cert is not None:
        args += ["--cert", cert[0], "--key", cert[1]]
    r = curl(*args, "-H", f"Authorization: Bearer {ADMIN_TOKEN}", f"{mtls.url}/v1/stats")
    assert r.returncode in (35, 52, 56) and r.stdout == "000", r  # never an HTTP answer
    with pytest.raises(GatewayTLSError, match="refused this client's certificate"):
        client_for(mtls.url, ca=pki.ca, cert=cert)
    # the gateway is unharmed: the right certificate still gets in
    ok = curl("--cacert", pki.ca, "--cert", pki.node[0], "--key", pki.node[1], f"{mtls.url}/v1/stats")
    assert ok.stdout == "200", ok


def test_plain_http_to_the_tls_port_fails(mtls: TlsGateway, pki: Pki) -> None:
    plain = f"http://127.0.0.1:{mtls.port}/healthz"
    r = curl(plain)
    assert r.returncode in (52, 56) and r.stdout == "000", r  # the server closes: no HTTP answer in clear text
    with pytest.raises(httpx.TransportError):
        httpx.get(plain, timeout=10)
    ok = curl("--cacert", pki.ca, "--cert", pki.node[0], "--key", pki.node[1], f"{mtls.url}/healthz")
    assert ok.stdout == "200", ok


def test_https_client_against_a_plain_gateway_is_a_tls_error(gateway: Gateway, pki: Pki) -> None:
    """The other mix-up: a connector configured for https, pointed at a plain-HTTP port, fails at construction."""
    with pytest.raises(GatewayTLSError, match="TLS"):
        client_for(gateway.url.replace("http://", "https://"), ca=pki.ca, cert=pki.node)


def test_client_certificate_files_that_do_not_load_fail_at_construction(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(GatewayTLSError, match="cannot load the TLS files"):
        client_for("https://localhost:1", ca=tmp_path / "missing.pem")
    with pytest.raises(GatewayTLSError, match="cannot load the TLS files"):
        client_for("https://localhost:1", ca=pki.ca, cert=(pki.node[0], pki.stranger[1]))  # key of another cert


def test_cli_commands_take_the_tls_options(mtls: TlsGateway, pki: Pki, tmp_path: Path) -> None:
    """``kvgate stats`` / ``ls`` / ``purge`` and ``bench`` with --cacert/--cert/--key (or their env variables)."""
    import sys

    from typer.testing import CliRunner

    from app.tools.cli import cli
    from tests.gateway import REPO

    runner = CliRunner()
    tls = ["--cacert", str(pki.ca), "--cert", str(pki.node[0]), "--key", str(pki.node[1])]
    wide = {"COLUMNS": "250", "NO_COLOR": "1"}
    st = runner.invoke(cli, ["stats", "--url", mtls.url, *tls], env=wide)
    assert st.exit_code == 0 and "namespaces" in st.output, st.output
    env = {**wide, "KVGATE_URL": mtls.url, "KVGATE_CACERT": str(pki.ca)}
    env |= {"KVGATE_CLIENT_CERT": str(pki.node[0]), "KVGATE_CLIENT_KEY": str(pki.node[1])}
    assert runner.invoke(cli, ["ls"], env=env).exit_code == 0
    from tests.security.conftest import OTHER_NS

    with client_for(mtls.url, ca=pki.ca, cert=pki.node) as bc:
        assert bc.run(bc.put(key_for(900, namespace=OTHER_NS), b"x" * 1000))
    purge = runner.invoke(cli, ["purge", "--yes", OTHER_NS], env=env)
    assert purge.exit_code == 0 and "1 blocks" in purge.output, purge.output
    refused = runner.invoke(cli, ["stats", "--url", mtls.url, "--cacert", str(pki.ca)], env=wide)
    assert refused.exit_code == 2 and "cannot reach" in refused.output  # no client certificate: no connection

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "app", "bench", "--url", mtls.url, *tls, "-n", "8", "-c", "4"]
    cmd += ["--block-size", "65536", "--json", str(out), "--quiet"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["verify_failures"] == 0
    assert result["phases"][1]["ops"]["get"]["ok"] == 8
