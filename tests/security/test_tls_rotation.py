"""Certificate rotation without a restart, and the start-up rule on transport security."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from app.api.server.bind import bind_warnings
from app.config import Settings, TokenSpec
from loopback.tls_pki import CA, Leaf, TlsGateway, client_context, served_cert
from tests.conftest import key_for, random_bytes
from tests.gateway import REPO, free_port


def wait_for(what: str, cond: Callable[[], bool], *, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def start(tmp_path: Path, ca: CA, leaf: Leaf, **env: str) -> tuple[TlsGateway, Path]:
    cert, key = leaf.write(tmp_path / "tls", "server")
    ca_path = ca.write(tmp_path / "tls" / "ca.pem")
    gw = TlsGateway(
        tmp_path / "data",
        ca=ca_path,
        env={"KVGATE_TLS_CERTFILE": str(cert), "KVGATE_TLS_KEYFILE": str(key), "KVGATE_LOG_LEVEL": "info", **env},
    ).start()
    return gw, ca_path


@pytest.mark.parametrize("trigger", ["file-change", "sighup"])
def test_rotated_certificate_is_served_to_the_next_connection(tmp_path: Path, trigger: str) -> None:
    """The files are replaced on disk; the next handshake gets the new certificate, from the same process, which
    still holds its blocks, while a connection opened before the rotation keeps working."""
    ca = CA()
    old, new = ca.issue("kvgate-old", server=True), ca.issue("kvgate-new", server=True)
    interval = "0.2" if trigger == "file-change" else "0"
    gw, ca_path = start(tmp_path, ca, old, KVGATE_TLS_RELOAD_INTERVAL_S=interval)
    try:
        assert gw.proc is not None
        pid = gw.proc.pid
        key, blob = key_for(301), random_bytes(500_000, seed=301)
        with httpx.Client(base_url=gw.url, verify=client_context(ca=ca_path), timeout=30) as before:
            assert before.put(f"/v1/blocks/{key}", content=blob).status_code == 201
            assert served_cert(gw.port, ca=ca_path).serial_number == old.cert.serial_number

            new.write(tmp_path / "tls", "server")
            if trigger == "sighup":
                gw.proc.send_signal(signal.SIGHUP)
            wait_for(
                "the new certificate is served",
                lambda: served_cert(gw.port, ca=ca_path).serial_number == new.cert.serial_number,
            )
            assert before.get(f"/v1/blocks/{key}").content == blob  # the kept-alive connection still works
        assert gw.proc.poll() is None and gw.proc.pid == pid
        with httpx.Client(base_url=gw.url, verify=client_context(ca=ca_path), timeout=30) as after:
            assert after.get(f"/v1/blocks/{key}").content == blob  # no restart: the cache is all there
    finally:
        gw.stop()


def test_a_torn_rotation_keeps_the_old_certificate(tmp_path: Path) -> None:
    """A new certificate whose key has not arrived yet is refused (logged); the old pair is served until the key
    lands, then the new one."""
    ca = CA()
    old, new = ca.issue("kvgate-old", server=True), ca.issue("kvgate-new", server=True)
    gw, ca_path = start(tmp_path, ca, old, KVGATE_TLS_RELOAD_INTERVAL_S="0")
    try:
        assert gw.proc is not None
        cert_path = tmp_path / "tls" / "server.crt"
        cert_path.write_bytes(new.cert_pem)  # the key file still holds the old key
        gw.proc.send_signal(signal.SIGHUP)
        wait_for("the refused reload is logged", lambda: "TLS files not reloaded" in gw.log())
        assert served_cert(gw.port, ca=ca_path).serial_number == old.cert.serial_number
        (tmp_path / "tls" / "server.key").write_bytes(new.key_pem)
        gw.proc.send_signal(signal.SIGHUP)
        wait_for(
            "the new certificate is served",
            lambda: served_cert(gw.port, ca=ca_path).serial_number == new.cert.serial_number,
        )
    finally:
        gw.stop()


def serve_exit(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``kvgate serve`` expected to refuse to start: its exit status and stderr."""
    full = {**os.environ, "PYTHONPATH": str(REPO), "KVGATE_DATA_DIR": str(tmp_path / "data"), **env}
    argv = [sys.executable, "-m", "app", "serve", "--port", str(free_port())]
    return subprocess.run(argv, env=full, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def test_require_tls_refuses_to_start_without_tls(tmp_path: Path) -> None:
    r = serve_exit(tmp_path, KVGATE_REQUIRE_TLS="true")
    assert r.returncode == 2, r
    assert "refusing to start without TLS" in r.stderr


def test_tls_files_that_do_not_load_refuse_to_start(tmp_path: Path) -> None:
    ca = CA()
    cert, _key = ca.issue("kvgate", server=True).write(tmp_path, "server")
    _cert2, other_key = ca.issue("kvgate", server=True).write(tmp_path, "other")
    r = serve_exit(tmp_path, KVGATE_TLS_CERTFILE=str(cert), KVGATE_TLS_KEYFILE=str(other_key))
    assert r.returncode == 2 and "cannot load the TLS files" in r.stderr, r
    r = serve_exit(tmp_path, KVGATE_TLS_CERTFILE=str(tmp_path / "missing.crt"))
    assert r.returncode == 2 and "missing.crt" in r.stderr, r


def test_non_loopback_bind_without_tls_is_warned_about(tmp_path: Path) -> None:
    """The rule itself (binding a public address is not done in tests): one warning naming the risk; none with
    TLS or on loopback; with require_tls the same bind is refused."""
    cert = tmp_path / "c.pem"
    (warning,) = bind_warnings(Settings(host="10.1.2.3"))
    assert "without TLS" in warning and "clear text" in warning and "KVGATE_REQUIRE_TLS" in warning
    assert bind_warnings(Settings(host="127.0.0.1")) == []
    assert bind_warnings(Settings(host="10.1.2.3", tls_certfile=cert)) == []
    with pytest.raises(ValueError, match="without TLS"):
        bind_warnings(Settings(host="10.1.2.3", require_tls=True))
    with pytest.raises(ValueError, match="without TLS"):
        bind_warnings(Settings(host="127.0.0.1", require_tls=True))
    cert_only = TokenSpec(name="node", cert_subject="CN=node", role="read")
    (warning,) = bind_warnings(Settings(tokens=[cert_only], tls_certfile=cert))
    assert "KVGATE_TLS_CLIENT_CA is not set" in warning
    assert bind_warnings(Settings(tokens=[cert_only], tls_certfile=cert, tls_client_ca=cert)) == []


def test_minimum_tls_version(tmp_path: Path) -> None:
    """KVGATE_TLS_MIN_VERSION=1.3: a client that speaks at most TLS 1.2 gets no connection; 1.3 does."""
    ca = CA()
    gw, ca_path = start(tmp_path, ca, ca.issue("kvgate", server=True), KVGATE_TLS_MIN_VERSION="1.3")
    try:
        old = client_context(ca=ca_path)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(httpx.ConnectError):  # the handshake ends without a connection
            httpx.get(f"{gw.url}/healthz", verify=old)
        assert httpx.get(f"{gw.url}/healthz", verify=client_context(ca=ca_path)).status_code == 200
    finally:
        gw.stop()
