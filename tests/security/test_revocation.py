"""Revocation without a restart: a CA taken out of the client-CA bundle, or a principal taken out of the tokens
file, is refused from the next connection or request on, after SIGHUP or when the file changes; a reload of files
that do not load (half written) keeps what was in use, and the process (with its cache) is the same throughout."""

from __future__ import annotations

import json
import signal
import ssl
from pathlib import Path

import httpx
import pytest

from loopback.tls_pki import CA, TlsGateway, client_context, served_cert
from tests.conftest import key_for, random_bytes
from tests.gateway import Gateway
from tests.security.conftest import TOKENS, bearer, tokens_json
from tests.security.test_tls_rotation import wait_for

KEY, DATA = key_for(41), random_bytes(2000, 41)


def tls_reloads(log: str) -> int:
    """Reloads of the TLS files the log reports done (not the refused ones)."""
    return sum(1 for line in log.splitlines() if "TLS" in line and " reloaded (" in line and "not reloaded" not in line)


def handshake(gw: TlsGateway, *, ca: Path, cert: tuple[Path, Path]) -> int | str:
    """A new connection presenting ``cert``: the status of an admin GET, or why the TLS handshake failed."""
    try:
        with httpx.Client(base_url=gw.url, verify=client_context(ca=ca, cert=cert), timeout=10) as c:
            return c.get(f"/v1/blocks/{KEY}", headers=bearer("admin")).status_code
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, ssl.SSLError) as exc:
        return f"refused: {exc}"


@pytest.mark.parametrize("trigger", ["sighup", "file-change"])
def test_a_ca_taken_out_of_the_bundle_is_no_longer_trusted(tmp_path: Path, trigger: str) -> None:
    server_ca, old_ca, kept_ca = CA("server CA"), CA("retired CA"), CA("kept CA")
    tls = tmp_path / "tls"
    server = server_ca.issue("kvgate", server=True).write(tls, "server")
    retired = old_ca.issue("node-a").write(tls, "retired")
    kept = kept_ca.issue("node-b").write(tls, "kept")
    server_ca_path = server_ca.write(tls / "server-ca.pem")
    bundle = tls / "clients.pem"
    bundle.write_bytes(old_ca.write(tls / "old.pem").read_bytes() + kept_ca.write(tls / "kept.pem").read_bytes())
    env = {
        "KVGATE_TLS_CERTFILE": str(server[0]),
        "KVGATE_TLS_KEYFILE": str(server[1]),
        "KVGATE_TLS_CLIENT_CA": str(bundle),
        "KVGATE_TLS_RELOAD_INTERVAL_S": "0.2" if trigger == "file-change" else "0",
        "KVGATE_TOKENS": tokens_json(),
    }
    gw = TlsGateway(tmp_path / "data", ca=server_ca_path, ready_cert=kept, env=env).start()
    try:
        assert gw.proc is not None
        pid = gw.proc.pid
        with httpx.Client(base_url=gw.url, verify=client_context(ca=server_ca_path, cert=kept), timeout=10) as c:
            assert c.put(f"/v1/blocks/{KEY}", content=DATA, headers=bearer("admin")).status_code == 201
        assert handshake(gw, ca=server_ca_path, cert=retired) == 200
        bundle.write_bytes((tls / "kept.pem").read_bytes())  # the retired CA is taken out
        if trigger == "sighup":
            gw.proc.send_signal(signal.SIGHUP)
        wait_for("the reload is logged", lambda: tls_reloads(gw.log()) == 1)
        assert str(handshake(gw, ca=server_ca_path, cert=retired)).startswith("refused")
        assert handshake(gw, ca=server_ca_path, cert=kept) == 200
        # a reload of a bundle that is not PEM (half written) keeps the one in use
        bundle.write_bytes(b"-----BEGIN CERTIFICATE-----\nMIIB")
        gw.proc.send_signal(signal.SIGHUP)
        wait_for("the refused reload is logged", lambda: "TLS files not reloaded" in gw.log())
        assert handshake(gw, ca=server_ca_path, cert=kept) == 200
        assert str(handshake(gw, ca=server_ca_path, cert=retired)).startswith("refused")
        assert gw.proc.poll() is None and gw.proc.pid == pid
    finally:
        gw.stop()


def test_a_torn_certificate_rotation_keeps_a_working_context(tmp_path: Path) -> None:
    """Certificate and key are rewritten one after the other, each reload racing the other file: every reload either
    serves a whole new pair or keeps the old one, and every handshake in between succeeds."""
    ca = CA()
    tls = tmp_path / "tls"
    pairs = [ca.issue(f"kvgate-{i}", server=True) for i in range(4)]
    cert, key = pairs[0].write(tls, "server")
    ca_path = ca.write(tls / "ca.pem")
    env = {"KVGATE_TLS_CERTFILE": str(cert), "KVGATE_TLS_KEYFILE": str(key), "KVGATE_TLS_RELOAD_INTERVAL_S": "0"}
    gw = TlsGateway(tmp_path / "data", ca=ca_path, env=env).start()
    try:
        assert gw.proc is not None
        serials = {p.cert.serial_number for p in pairs}
        for leaf in pairs[1:]:
            cert.write_bytes(leaf.cert_pem)  # the key is still the previous pair's
            gw.proc.send_signal(signal.SIGHUP)
            assert served_cert(gw.port, ca=ca_path).serial_number in serials
            key.write_bytes(leaf.key_pem)
            gw.proc.send_signal(signal.SIGHUP)
            assert served_cert(gw.port, ca=ca_path).serial_number in serials
            wait_for(
                "the new pair is served",
                lambda leaf=leaf: served_cert(gw.port, ca=ca_path).serial_number == leaf.cert.serial_number,
            )
        assert "TLS files not reloaded" in gw.log()
        assert gw.proc.poll() is None
    finally:
        gw.stop()


def _tokens_file(path: Path, *, without: tuple[str, ...] = ()) -> None:
    path.write_text(json.dumps([e for e in json.loads(tokens_json()) if e["name"] not in without]))


@pytest.mark.parametrize("trigger", ["sighup", "file-change"])
def test_a_principal_taken_out_of_the_tokens_file_is_refused(tmp_path: Path, trigger: str) -> None:
    tokens = tmp_path / "tokens.json"
    _tokens_file(tokens)
    interval = "0.2" if trigger == "file-change" else "0"
    gw = Gateway(
        tmp_path / "data", env={"KVGATE_TOKENS_FILE": str(tokens), "KVGATE_TOKENS_RELOAD_INTERVAL_S": interval}
    )
    gw.start()
    try:
        assert gw.proc is not None
        pid = gw.proc.pid
        with httpx.Client(base_url=gw.url, timeout=10) as c:
            assert c.put(f"/v1/blocks/{KEY}", content=DATA, headers=bearer("admin")).status_code == 201
            assert c.get(f"/v1/blocks/{KEY}", headers=bearer("read")).status_code == 200

            _tokens_file(tokens, without=("reader",))
            if trigger == "sighup":
                gw.proc.send_signal(signal.SIGHUP)
            wait_for("the reload is logged", lambda: "tokens file reloaded" in gw.log())
            refused = c.get(f"/v1/blocks/{KEY}", headers=bearer("read"))
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
            assert c.get(f"/v1/blocks/{KEY}", headers=bearer("admin")).content == DATA

            # a torn write of the file: the table in use stays (the reader still out, the admin still in)
            tokens.write_text('[{"name": "admin", "sha256": "')
            gw.proc.send_signal(signal.SIGHUP)
            wait_for("the refused reload is logged", lambda: "tokens file not reloaded" in gw.log())
            assert c.get(f"/v1/blocks/{KEY}", headers=bearer("read")).status_code == 401
            assert c.get(f"/v1/blocks/{KEY}", headers=bearer("admin")).content == DATA

            # emptied: nobody (auth stays on; it is not turned off by an empty file)
            tokens.write_text("[]")
            gw.proc.send_signal(signal.SIGHUP)
            wait_for(
                "the empty table is in use", lambda: c.get("/v1/stats", headers=bearer("admin")).status_code == 401
            )
            assert c.get(f"/v1/blocks/{KEY}").status_code == 401

            _tokens_file(tokens)
            gw.proc.send_signal(signal.SIGHUP)
            wait_for(
                "the reader is back", lambda: c.get(f"/v1/blocks/{KEY}", headers=bearer("read")).status_code == 200
            )
        assert gw.proc.poll() is None and gw.proc.pid == pid
        assert TOKENS["read"] not in gw.log()
    finally:
        gw.stop()
