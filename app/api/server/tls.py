"""TLS on the gateway: the server's SSLContext, certificate rotation without a restart, and the peer certificate
in the request scope.

- :func:`server_context` builds the context uvicorn serves with: certificate chain and key, a minimum version and,
  with ``tls_client_ca``, client certificates (required or optional) verified against that bundle.
- :class:`CertReloader` re-reads the files into the SAME context (``load_cert_chain`` / ``load_verify_locations``)
  on SIGHUP or when their stat changes: the listening socket keeps its context, and OpenSSL copies the
  certificate into each new connection, so the next handshake serves the new certificate while open connections
  keep theirs. A new pair is first loaded into a throwaway context: a half-written rotation (a certificate whose
  key is not there yet) is refused with an error in the log, and the old pair stays. A CA bundle re-read adds
  the new CAs; one that drops a CA takes a restart. A rotation keeps the key type (RSA stays RSA, EC stays EC):
  OpenSSL keeps one certificate per key type, so a new type would be served next to the old one.
- :func:`with_peer_cert` (a uvicorn httptools protocol subclass, built for uvicorn 0.55) puts the verified client
  certificate into ``scope["extensions"]["tls"]``, in the shape of the ASGI TLS extension, plus the parsed form
  (``peercert``) that :mod:`app.api.middleware.cert_identity` maps to a principal. uvicorn itself puts no TLS
  data in the scope.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.api.middleware.cert_identity import subject_name
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
    except (OSError, ssl.SSLError) as exc:
        files = ", ".join(str(p) for p in (settings.tls_certfile, settings.tls_keyfile, settings.tls_client_ca) if p)
        raise ValueError(f"cannot load the TLS files ({files}): {exc}") from exc
    if settings.tls_client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED if settings.tls_client_auth == "required" else ssl.CERT_OPTIONAL
    return ctx


def _stamp(path: Path | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class CertReloader:
    """Keeps ``context`` in step with the certificate files: :meth:`reload` on demand, :meth:`watch` on change."""

    def __init__(self, *, context: ssl.SSLContext, settings: Settings) -> None:
        self.context = context
        self.settings = settings
        self.reloads = 0
        self._files = (settings.tls_certfile, settings.tls_keyfile, settings.tls_client_ca)
        self._stamps = self._current()

    def _current(self) -> tuple[tuple[int, int, int] | None, ...]:
        return tuple(_stamp(p) for p in self._files)

    def reload(self, *, why: str) -> bool:
        """Load the files again; False (and the old certificate kept) when the new ones do not load."""
        self._stamps = self._current()
        try:
            _load(_new_context(self.settings), self.settings)  # a torn rotation must not reach the live context
            _load(self.context, self.settings)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.error("TLS files not reloaded (%s), still serving the previous certificate: %s", why, exc)
            return False
        self.reloads += 1
        log.warning("TLS certificate reloaded (%s) from %s", why, self.settings.tls_certfile)
        return True

    def reload_if_changed(self) -> bool:
        if self._current() == self._stamps:
            return False
        return self.reload(why="files changed")

    async def watch(self, *, interval_s: float) -> None:
        """Poll the files' stat; reload on the event loop's thread, the one that starts every handshake (an
        SSL_CTX must not change under a handshake in another thread; reading two PEM files takes well under 1 ms)."""
        while True:
            await asyncio.sleep(interval_s)
            self.reload_if_changed()


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
