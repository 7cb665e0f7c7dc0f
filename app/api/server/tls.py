"""TLS on the gateway: the server's SSLContext, certificate rotation without a restart, and the peer certificate
in the request scope.

- :func:`server_context` builds the context uvicorn serves with: certificate chain and key, a minimum version and,
  with ``tls_client_ca``, client certificates (required or optional) verified against that bundle.
- :class:`TlsContexts` re-reads the files on SIGHUP or when their stat changes into a NEW context, which serves
  every connection from the next handshake on (the listening context's SNI callback hands each connection to the
  newest): the new certificate is served, and a CA taken out of the client-CA bundle is no longer trusted, without
  a restart; open connections keep theirs. A rotation that does not load whole (a certificate whose key is not
  there yet) is refused with an error in the log, and the context in use stays as it was: no live context is
  ever changed in place.
- :func:`with_peer_cert` (a uvicorn httptools protocol subclass, built for uvicorn 0.55) puts the verified client
  certificate into ``scope["extensions"]["tls"]``, in the shape of the ASGI TLS extension, plus the parsed form
  (``peercert``) that :mod:`app.api.middleware.cert_identity` maps to a principal. uvicorn itself puts no TLS
  data in the scope.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING, Any

from app.api.middleware.cert_identity import subject_name
from app.api.reloading import Reloader
from app.config import Settings

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kvgate.tls")

TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
_WIRE_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}


def _new_context(settings: Settings) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[settings.tls_min_version]
    return ctx


def _load(ctx: ssl.SSLContext, settings: Settings) -> None:
    if settings.tls_certfile is None:
        raise ValueError("TLS needs tls_certfile")
    ctx.load_cert_chain(settings.tls_certfile, settings.tls_keyfile)
    if settings.tls_client_ca is not None:
        ctx.load_verify_locations(cafile=settings.tls_client_ca)


def server_context(settings: Settings) -> ssl.SSLContext:
    """The SSLContext to serve with; ValueError naming the file when one cannot be read or does not fit."""
    ctx = _new_context(settings)
    try:
        _load(ctx, settings)
    except OSError as exc:  # ssl.SSLError is one
        files = ", ".join(str(p) for p in (settings.tls_certfile, settings.tls_keyfile, settings.tls_client_ca) if p)
        raise ValueError(f"cannot load the TLS files ({files}): {exc}") from exc
    if settings.tls_client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED if settings.tls_client_auth == "required" else ssl.CERT_OPTIONAL
    return ctx


class TlsContexts(Reloader[ssl.SSLContext]):
    """The SSLContext uvicorn listens with (``listening``), and the one each new connection is served with
    (``current``): a reload builds a whole new context from the files, and the listening one's SNI callback (OpenSSL
    calls it on every ClientHello, with or without a server name) hands each new connection to the newest. So a
    rotated certificate is served, and a CA taken out of the client-CA bundle stops being trusted, from the next
    handshake on; open connections keep what they were made with."""

    what = "TLS files"

    def __init__(self, *, settings: Settings) -> None:
        super().__init__(
            files=(settings.tls_certfile, settings.tls_keyfile, settings.tls_client_ca),
            interval_s=settings.tls_reload_interval_s,
        )
        self.settings = settings
        self.listening = server_context(settings)
        self.current = self.listening
        self.listening.sni_callback = self._hand_over

    def _hand_over(self, conn: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        current = self.current
        if current is not self.listening:
            conn.context = current

    def load(self) -> ssl.SSLContext:
        return server_context(self.settings)

    def install(self, value: ssl.SSLContext) -> None:
        self.current = value


# -- the peer certificate in the scope ----------------------------------------------------------------------------


def tls_extension(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> dict[str, Any] | None:
    """``scope["extensions"]["tls"]`` for a connection: the ASGI TLS extension's fields, plus ``peercert`` (the
    verified client certificate as ``getpeercert()`` parses it; None without one)."""
    if ssl_object is None:
        return None
    peercert = ssl_object.getpeercert() or None  # {} when none was presented or verification is off
    der = ssl_object.getpeercert(binary_form=True) if peercert else None
    version = ssl_object.version()
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
        "client_cert_name": subject_name(peercert) if peercert else None,
        "client_cert_error": None,
        "tls_version": _WIRE_VERSIONS.get(version or ""),
        "cipher_suite": None,
        "peercert": peercert,
    }


def with_peer_cert(base: type[HttpToolsProtocol]) -> type[HttpToolsProtocol]:
    """``base`` (uvicorn 0.55's httptools protocol or a subclass) adding the connection's TLS data to every scope.

    uvicorn builds each request's scope in ``on_message_begin``; the transport's ``ssl_object`` is there from
    ``connection_made`` on (asyncio and uvloop call it after the handshake), so it is read once per connection.
    """

    class PeerCertProtocol(base):  # type: ignore[valid-type, misc]
        _tls: dict[str, Any] | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._tls = tls_extension(transport.get_extra_info("ssl_object"))

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._tls is not None:
                self.scope["extensions"] = {**self.scope.get("extensions", {}), "tls": self._tls}

    PeerCertProtocol.__name__ = f"PeerCert{base.__name__}"
    return PeerCertProtocol
