"""Client certificates as principals: the auth matrix of the tokens holds for certificate principals (named by
subject or by SAN, in the same tokens file), a token and a certificate may both be used, and the subject is
written as openssl and cryptography write it."""

from __future__ import annotations

import json
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from app.api.middleware.cert_identity import CertPrincipals, alt_names, canonical_subject, subject_name
from app.config import TokenSpec
from loopback.tls_pki import CA, TlsGateway, client_context
from tests.conftest import TEST_NS
from tests.security.conftest import OTHER_NS, bearer, tokens_json
from tests.security.test_auth_matrix import CALLS, DATA, FIELDS, KEY, Call, expected

CERT_PRINCIPALS = [
    {"name": "cert-reader", "cert_subject": "CN=reader-node,O=kvgate-tests", "role": "read"},
    {"name": "cert-writer", "cert_san": "URI:spiffe://kvgate/writer", "role": "write"},
    {"name": "cert-admin", "cert_san": "DNS:Admin.KVGate.test", "role": "admin"},
    {"name": "cert-other", "cert_subject": "CN=other-node, O=kvgate-tests", "role": "write", "namespaces": [OTHER_NS]},
    {"name": "cert-scoped-admin", "cert_subject": "commonName=scoped-admin,O=kvgate-tests", "role": "admin"},
    {"name": "twice-a", "cert_subject": "CN=twice,O=kvgate-tests", "role": "read"},
    {"name": "twice-b", "cert_san": "DNS:twice.kvgate.test", "role": "admin"},
]
CERT_PRINCIPALS[4]["namespaces"] = [TEST_NS]
# who (as in test_auth_matrix.WHO) -> the client certificate that stands for it; None: none presented
SUBJECTS: dict[str, tuple[str, dict[str, list[str]]] | None] = {
    "none": None,
    "bad": ("stranger", {}),  # a valid certificate from the trusted CA that names no principal
    "read": ("reader-node", {}),
    "write": ("writer-node", {"uris": ["spiffe://kvgate/writer"]}),
    "admin": ("admin-node", {"dns": ["admin.kvgate.test"]}),
    "other": ("other-node", {}),
    "scoped_admin": ("scoped-admin", {}),
    "twice": ("twice", {"dns": ["twice.kvgate.test"]}),
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[Path, Path] | None]]:
    d = tmp_path_factory.mktemp("auth-pki")
    ca = CA()
    paths: dict[str, tuple[Path, Path] | None] = {"server": ca.issue("kvgate", server=True).write(d, "server")}
    for who, spec in SUBJECTS.items():
        paths[who] = None if spec is None else ca.issue(spec[0], **spec[1]).write(d, who)  # type: ignore[arg-type]
    return ca.write(d / "ca.pem"), paths


@pytest.fixture(scope="module")
def gw(
    certs: tuple[Path, dict[str, tuple[Path, Path] | None]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsGateway]:
    ca, paths = certs
    server = paths["server"]
    assert server is not None
    tokens_file = tmp_path_factory.mktemp("auth-tokens") / "principals.json"
    tokens_file.write_text(json.dumps([*json.loads(tokens_json()), *CERT_PRINCIPALS]))
    env = {
        "KVGATE_TLS_CERTFILE": str(server[0]),
        "KVGATE_TLS_KEYFILE": str(server[1]),
        "KVGATE_TLS_CLIENT_CA": str(ca),
        "KVGATE_TLS_CLIENT_AUTH": "optional",
        "KVGATE_TOKENS_FILE": str(tokens_file),
    }
    gateway = TlsGateway(tmp_path_factory.mktemp("auth") / "data", ca=ca, env=env).start()
    with httpx.Client(base_url=gateway.url, headers=bearer("admin"), verify=client_context(ca=ca)) as c:
        assert c.put(f"/v1/blocks/{KEY}", content=DATA).status_code == 201
        assert c.put(f"/v1/namespaces/{TEST_NS}/config", json=FIELDS).status_code == 201
    yield gateway
    gateway.stop()


def cert_client(gw: TlsGateway, certs: tuple[Path, dict[str, tuple[Path, Path] | None]], who: str) -> httpx.Client:
    ca, paths = certs
    return httpx.Client(base_url=gw.url, verify=client_context(ca=ca, cert=paths[who]), timeout=30)


@pytest.mark.parametrize("who", [w for w in SUBJECTS if w != "twice"])
@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c.method} {c.url[:40]}")
def test_matrix_with_certificate_principals(
    gw: TlsGateway, certs: tuple[Path, dict[str, tuple[Path, Path] | None]], call: Call, who: str
) -> None:
    with cert_client(gw, certs, who) as c:
        r = c.request(call.method, call.url, content=call.body, json=call.json)
    want = expected(call, who)
    if want == "ok":
        assert r.status_code in call.ok, (who, call, r.status_code, r.text[:300])
        return
    assert r.status_code == int(want), (who, call, r.status_code, r.text[:300])
    if call.method != "HEAD":
        assert r.json()["error"]["code"] == ("unauthorized" if want == "401" else "forbidden")


def test_a_request_may_use_either_a_token_or_a_certificate(
    gw: TlsGateway, certs: tuple[Path, dict[str, tuple[Path, Path] | None]]
) -> None:
    with cert_client(gw, certs, "read") as c:
        assert c.get("/v1/stats").status_code == 403  # the certificate: read
        assert c.get("/v1/stats", headers=bearer("admin")).status_code == 200  # a token takes precedence
        r = c.get("/v1/stats", headers={"Authorization": "Bearer not-a-token"})
        assert r.status_code == 401  # a bad token is not rescued by a good certificate
    with cert_client(gw, certs, "none") as c:
        assert c.get("/v1/stats", headers=bearer("admin")).status_code == 200
        assert "client certificate" in c.get("/v1/stats").json()["error"]["message"]
    with cert_client(gw, certs, "twice") as c:  # two entries name it: refused, not a guess
        r = c.get(f"/v1/blocks/{KEY}")
        assert r.status_code == 401 and "several principals" in r.json()["error"]["message"]


# -- subjects and SANs as openssl and cryptography write them -------------------------------------------------------


def peercert_of(path: Path) -> dict[str, object]:
    """The dict ``getpeercert()`` gives for this certificate (the decoder the ssl module uses for it)."""
    return ssl._ssl._test_decode_cert(str(path))  # type: ignore[attr-defined, no-any-return]


def test_subject_matches_openssl_and_cryptography(tmp_path: Path) -> None:
    ca = CA()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COUNTRY_NAME, "DE"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Acme, Inc."),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "inference"),
            x509.NameAttribute(NameOID.COMMON_NAME, "node+7"),
        ]
    )
    leaf = ca.issue("x", dns=["Node-7.Cluster"], uris=["spiffe://c/n7"])
    builder = x509.CertificateBuilder(
        issuer_name=leaf.cert.issuer,
        subject_name=name,
        public_key=leaf.key.public_key(),
        serial_number=1,
        not_valid_before=leaf.cert.not_valid_before_utc,
        not_valid_after=leaf.cert.not_valid_after_utc,
        extensions=list(leaf.cert.extensions),
    )
    from cryptography.hazmat.primitives import hashes

    cert = builder.sign(ca.key, hashes.SHA256())
    from loopback.tls_pki import Leaf

    path, _ = Leaf(cert=cert, key=leaf.key).write(tmp_path, "n7")
    parsed = peercert_of(path)
    ours = subject_name(parsed)
    assert ours == cert.subject.rfc4514_string() == "CN=node\\+7,OU=inference,O=Acme\\, Inc.,C=DE"
    openssl = subprocess.run(
        ["openssl", "x509", "-in", str(path), "-noout", "-subject", "-nameopt", "RFC2253"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert openssl == f"subject={ours}"
    assert canonical_subject("cn=node\\+7, ou=inference, O=Acme\\, Inc., countryName=DE") == ours
    assert alt_names(parsed) == ["DNS:node-7.cluster", "URI:spiffe://c/n7"]
    table = CertPrincipals(
        [
            TokenSpec(name="by-subject", cert_subject=" CN=node\\+7 , OU=inference,O=Acme\\, Inc.,C=DE", role="read"),
            TokenSpec(name="by-dns", cert_san="dns:NODE-7.cluster", role="read"),
            TokenSpec(name="elsewhere", cert_san="URI:spiffe://c/n8", role="read"),
        ]
    )
    assert sorted(s.name for s in table.match(parsed)) == ["by-dns", "by-subject"]


def test_a_principal_needs_a_credential() -> None:
    with pytest.raises(ValueError, match="needs sha256, cert_subject or cert_san"):
        TokenSpec(name="nobody", role="admin")
    with pytest.raises(ValueError):
        TokenSpec(name="bad-san", cert_san="X400:whatever", role="read")
