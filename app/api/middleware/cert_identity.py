"""Client certificates as identities: a verified peer certificate's subject or SAN -> the principals that name it.

The gateway sees a peer certificate only after the TLS handshake verified it against ``tls_client_ca`` (see
:mod:`app.api.server.tls`, which puts it into the request scope). A principal in the tokens file names a certificate by

- ``cert_subject``: the subject as RFC 4514 writes it, most specific RDN first, short attribute names (``CN``,
  ``O``, ``OU``, ``C``, ``ST``, ``L``, ``DC``, ``UID``), e.g. ``CN=node-1,O=acme``: what
  ``openssl x509 -noout -subject -nameopt RFC2253`` and ``cryptography``'s ``Name.rfc4514_string()`` print;
- ``cert_san``: one subject alternative name, ``TYPE:value`` with TYPE ``DNS``, ``URI``, ``IP`` or ``email``.

Attribute names and SAN types compare case-insensitively, DNS names too; other values exactly.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable
from typing import Any

from app.config import TokenSpec

log = logging.getLogger("kvgate.auth")

PeerCert = dict[str, Any]
"""``ssl.SSLObject.getpeercert()``: ``subject`` is a tuple of RDNs, each a tuple of (long name, value) pairs."""

_SHORT = {
    "commonname": "CN",
    "organizationname": "O",
    "organizationalunitname": "OU",
    "countryname": "C",
    "stateorprovincename": "ST",
    "localityname": "L",
    "streetaddress": "STREET",
    "domaincomponent": "DC",
    "userid": "UID",
}
_SAN_TYPES = {"dns": "DNS", "uri": "URI", "ip address": "IP", "ip": "IP", "email": "email"}
_SPECIAL = re.compile(r'([,+"\\<>;=])')
_UNESCAPED_COMMA = re.compile(r"(?<!\\),")


def _escape(value: str) -> str:
    out = _SPECIAL.sub(r"\\\1", value)
    if out.startswith(("#", " ")):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out


_SHORT_NAMES = {short.upper(): short for short in _SHORT.values()}


def _attr(name: str) -> str:
    """``commonName`` / ``cn`` / ``CN`` -> ``CN``; a name without a short form is kept as it is."""
    return _SHORT.get(name.lower()) or _SHORT_NAMES.get(name.upper(), name)


def subject_name(cert: PeerCert) -> str | None:
    """The certificate's subject as an RFC 4514 string (last RDN first); None when it has none."""
    rdns = cert.get("subject") or ()
    parts = ["+".join(f"{_attr(k)}={_escape(v)}" for k, v in rdn) for rdn in reversed(rdns)]
    return ",".join(parts) or None


def canonical_subject(text: str) -> str:
    """A configured subject in the form :func:`subject_name` produces: spaces around ``,`` and ``=`` dropped,
    attribute names made short and upper-case (``commonName`` -> ``CN``)."""
    parts = []
    for rdn in _UNESCAPED_COMMA.split(text.strip()):
        name, sep, value = rdn.strip().partition("=")
        if not sep:
            raise ValueError(f"cert_subject {text!r}: {rdn!r} is not NAME=value")
        parts.append(f"{_attr(name.strip())}={value.strip()}")
    return ",".join(parts)


def _canonical_san(kind: str, value: str) -> str | None:
    typ = _SAN_TYPES.get(kind.strip().lower())
    if typ is None:
        return None
    value = value.strip()
    if typ == "DNS":
        value = value.lower()
    elif typ == "IP":
        try:
            value = str(ipaddress.ip_address(value))
        except ValueError:
            return None
    return f"{typ}:{value}"


def alt_names(cert: PeerCert) -> list[str]:
    """The certificate's subject alternative names as ``TYPE:value`` (types kvgate does not match are left out)."""
    names = []
    for kind, value in cert.get("subjectAltName") or ():
        san = _canonical_san(str(kind), str(value))
        if san is not None:
            names.append(san)
    return names


def canonical_san(text: str) -> str:
    kind, sep, value = text.partition(":")
    san = _canonical_san(kind, value) if sep else None
    if san is None:
        raise ValueError(f"cert_san {text!r}: not TYPE:value with TYPE DNS, URI, IP or email")
    return san


class CertPrincipals:
    """Verified peer certificate -> the entries of the tokens file that name it (by subject or SAN)."""

    def __init__(self, specs: Iterable[TokenSpec]) -> None:
        self._by_subject: dict[str, list[TokenSpec]] = {}
        self._by_san: dict[str, list[TokenSpec]] = {}
        for spec in specs:
            if spec.cert_subject is not None:
                self._by_subject.setdefault(canonical_subject(spec.cert_subject), []).append(spec)
            if spec.cert_san is not None:
                self._by_san.setdefault(canonical_san(spec.cert_san), []).append(spec)

    def __len__(self) -> int:
        return sum(map(len, self._by_subject.values())) + sum(map(len, self._by_san.values()))

    def match(self, cert: PeerCert) -> list[TokenSpec]:
        """Every entry naming ``cert``, each once, in no particular order."""
        found: dict[str, TokenSpec] = {}
        subject = subject_name(cert)
        if subject is not None:
            for spec in self._by_subject.get(subject, ()):
                found[spec.name] = spec
        for san in alt_names(cert):
            for spec in self._by_san.get(san, ()):
                found[spec.name] = spec
        return list(found.values())

    def authenticate(self, cert: PeerCert | None) -> tuple[TokenSpec | None, str]:
        """The one entry naming ``cert``, or None and the reason for a 401."""
        if cert is None:
            return None, "a bearer token or a client certificate is required"
        found = self.match(cert)
        if len(found) == 1:
            return found[0], ""
        subject = subject_name(cert)
        if found:
            log.warning("client certificate %s names %d principals: refused", subject, len(found))
            return None, "the client certificate names several principals"
        log.info("client certificate %s names no principal", subject)
        return None, "the client certificate names no principal"


def peer_cert(scope: Any) -> PeerCert | None:
    """The verified client certificate of the request's connection, if it presented one (the server's TLS protocol
    puts it into ``scope["extensions"]["tls"]["peercert"]``: :mod:`app.api.server.tls`)."""
    tls = (scope.get("extensions") or {}).get("tls")
    return tls.get("peercert") if isinstance(tls, dict) else None
