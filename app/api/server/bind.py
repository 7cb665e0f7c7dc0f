"""The start-up rules on who can reach the gateway: no non-loopback bind without principals, and the warnings (or
the refusal, with ``require_tls``) about serving without TLS."""

from __future__ import annotations

import ipaddress

from app.api.middleware.principals import load_tokens
from app.config import Settings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(settings: Settings) -> None:
    """Refuse to serve a non-loopback address without principals (raises ValueError with the reason)."""
    if not is_loopback(settings.host) and not load_tokens(settings):
        raise ValueError(
            f"refusing to listen on {settings.host}: no tokens are configured, so anyone who can reach it could "
            "read and delete every block. Set KVGATE_TOKENS or KVGATE_TOKENS_FILE (see `kvgate token new`; an "
            "entry may name a client certificate instead), or bind 127.0.0.1."
        )


def bind_warnings(settings: Settings) -> list[str]:
    """The start-up rule on transport security: a non-loopback bind without TLS is warned about, or refused
    (ValueError) with ``require_tls``; certificate principals without client certificates are warned about."""
    warnings = []
    if settings.tls_client_ca is None and any(s.cert_subject or s.cert_san for s in load_tokens(settings)):
        warnings.append(
            "the tokens name client certificates (cert_subject / cert_san) but KVGATE_TLS_CLIENT_CA is not set: "
            "no client certificate is asked for, so those principals can never authenticate"
        )
    if settings.tls_enabled:
        return warnings
    if settings.require_tls:
        raise ValueError(
            "refusing to start without TLS (KVGATE_REQUIRE_TLS is set): set KVGATE_TLS_CERTFILE and "
            "KVGATE_TLS_KEYFILE (see docs/operations.md, TLS and mutual TLS)"
        )
    if not is_loopback(settings.host):
        warnings.append(
            f"listening on {settings.host} without TLS: bearer tokens and KV blocks (the users' prompts in another "
            "form) cross the network in clear text, readable and alterable by anyone on the path. Set "
            "KVGATE_TLS_CERTFILE / KVGATE_TLS_KEYFILE, and KVGATE_REQUIRE_TLS=true to make this an error."
        )
    return warnings
