"""Certificates made for the tests and benchmarks (``cryptography``), and a gateway serving HTTPS on a loopback port."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from loopback.gateway import REPO, Gateway

NOW = dt.datetime.now(dt.UTC)
DAY = dt.timedelta(days=1)


def _name(cn: str, org: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, org), x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class Leaf:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _pem_key(self.key)

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        """``<stem>.crt`` and ``<stem>.key`` in ``directory``, each replaced atomically (as a rotation would)."""
        directory.mkdir(parents=True, exist_ok=True)
        paths = directory / f"{stem}.crt", directory / f"{stem}.key"
        for path, data in zip(paths, (self.cert_pem, self.key_pem), strict=True):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return paths


class CA:
    """A self-signed test CA that issues server and client certificates."""

    def __init__(self, name: str = "kvgate test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(name, "kvgate-tests")
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - DAY)
            .not_valid_after(NOW + 30 * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return path

    def issue(
        self,
        cn: str,
        *,
        server: bool = False,
        org: str = "kvgate-tests",
        dns: Sequence[str] = (),
        uris: Sequence[str] = (),
        not_before: dt.datetime | None = None,
        not_after: dt.datetime | None = None,
    ) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        if server:
            sans += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn, org))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before or NOW - DAY)
            .not_valid_after(not_after or NOW + 10 * DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return Leaf(cert=builder.sign(self.key, hashes.SHA256()), key=key)


def client_context(*, ca: Path | None, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert is not None:
        ctx.load_cert_chain(cert[0], cert[1])
    return ctx


def served_cert(port: int, *, ca: Path) -> x509.Certificate:
    """The certificate a NEW connection to 127.0.0.1:port is served (verified against ``ca``)."""
    import socket

    ctx = client_context(ca=ca)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


class TlsGateway(Gateway):
    """``python -m app serve`` with HTTPS; the readiness poll presents ``ready_cert`` when the gateway asks for one."""

    name = "tls-gateway"

    def __init__(
        self,
        data_dir: Path,
        *,
        ca: Path,
        ready_cert: tuple[Path, Path] | None = None,
        ready_verify: bool = True,
        env: Mapping[str, str] | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(data_dir, env=env, workers=workers)
        self.ca = ca
        self.ready_cert = ready_cert
        self.ready_verify = ready_verify

    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}"

    def start(self, *, timeout_s: float = 30.0) -> TlsGateway:
        env = {**os.environ, "PYTHONPATH": str(REPO), "KVGATE_LOG_LEVEL": "warning", **self.extra_env}
        env.setdefault("KVGATE_DATA_DIR", str(self.data_dir))
        ctx = client_context(ca=self.ca, cert=self.ready_cert)
        if not self.ready_verify:  # a test of a certificate that no client may accept
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        argv = [sys.executable, "-m", "app", "serve", "--port", str(self.port)]
        if self.workers > 1:
            argv += ["--workers", str(self.workers)]

        def ready() -> bool:
            if httpx.get(f"{self.url}/readyz", timeout=1.0, verify=ctx).status_code != 200:
                return False
            return self.workers == 1 or self.all_workers_ready()

        self._spawn(argv, env=env, ready=ready, timeout_s=timeout_s)
        return self
